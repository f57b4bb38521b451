#!/bin/bash
# On the offline GPU machine, in the project root with .whl/ carried (benchmarks/gpu_wheels.sh): install
# memplan and what it lacks, run the acceptance run, then the test suite with CUDA visible, each under a
# time limit, packing everything into $OUT/results.tgz after each step (a run stopped by a limit still
# leaves what it did). GPU_LIMIT and SUITE_LIMIT: seconds for each (default 420 and 150); ONLY: gpu.py's --only.
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-out}; W=$OUT/w; mkdir -p "$W"
pack() { tar czf "$OUT/results.tgz" -C "$OUT" w; }
T0=$(date +%s)
nvidia-smi > "$W/smi.txt" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$W/install.log" 2>&1 || { pack; exit 3; }
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/mp . \
    >> "$W/install.log" 2>&1 || { pack; exit 4; }
export PYTHONPATH=/tmp/mp:/tmp/site PATH=/tmp/mp/bin:$PATH
echo "installed at +$(( $(date +%s) - T0 )) s" | tee -a "$W/install.log"
timeout "${GPU_LIMIT:-420}" python3 benchmarks/gpu.py --out "$W/gpu" ${ONLY:+--only "$ONLY"} > "$W/gpu.log" 2>&1
echo "gpu.py exit $? at +$(( $(date +%s) - T0 )) s" | tee -a "$W/gpu.log"
pack
if [ "${SUITE_LIMIT:-150}" -gt 0 ]; then
  # schemathesis and import-linter are not on such machines: their two test files are left out
  timeout "${SUITE_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider -n 14 -rfE -m "not gpu" \
      --ignore=tests/test_api_fuzz.py --ignore=tests/test_architecture.py tests > "$W/suite.log" 2>&1
  echo "suite exit $? at +$(( $(date +%s) - T0 )) s" | tee -a "$W/suite.log"
  pack
fi
cat "$W/gpu/section.md" 2>/dev/null; tail -3 "$W/suite.log" 2>/dev/null
