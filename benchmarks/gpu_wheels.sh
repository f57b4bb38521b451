#!/bin/bash
# On a machine with the package registry, in the project root: download into .whl/ the wheels an offline
# GPU machine (Python 3.12, its own torch) lacks to run memplan and its tests, at the versions this
# virtualenv has. Then carry .whl to the GPU machine and run benchmarks/gpu_run.sh there. PEERS=1 adds
# the wheels of gpu.py --only peers (torchao, DeepSpeed and what DeepSpeed imports; about 6 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
# the checkout's own exclude file (in a worktree .git is a file: ask git where it is)
exclude=$(git rev-parse --git-path info/exclude 2>/dev/null || echo .git/info/exclude)
grep -qx '/.whl/' "$exclude" 2>/dev/null || { mkdir -p "$(dirname "$exclude")"; echo /.whl/ >> "$exclude"; }
PY=${PYTHON:-.venv/bin/python}
# fastapi 0.16x imports opentelemetry-api; OR-Tools needs immutabledict and a recent protobuf
NAMES="ortools pulp highspy pydantic pydantic_core annotated-types typing-inspection fastapi opentelemetry-api
starlette uvicorn immutabledict protobuf typing_extensions"
PINS=$($PY -m pip freeze | python3 -c "
import sys
want = {n.lower().replace('_', '-') for n in '''$NAMES'''.split()}
for line in sys.stdin:
    name = line.split('==')[0].strip().lower().replace('_', '-')
    if name in want and '==' in line:
        print(line.strip())")
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl $PINS
if [ "${PEERS:-0}" = 1 ]; then
  # gpu.py --only peers: torchao (its CPUOffloadOptimizer is Python; its C++ kernels, built for another torch,
  # are only warned about) and DeepSpeed, whose PyPI release is a source archive: built here into a wheel
  # with no ops compiled (DS_BUILD_OPS=0; ZeRO-Offload runs torch's AdamW on the host, so none is needed)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl torchao==0.18.0 hjson msgpack ninja py-cpuinfo einops
  DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation --no-binary=deepspeed -w .whl deepspeed==0.19.8
fi
ls .whl
