"""The GPU acceptance run (benchmarks/gpu.py) end to end under the CUDA emulation (``--smoke``): a GPU session
gets 15 minutes of device time, and a script that broke since the last one would spend them finding out.
Every step runs without an error, every planned variant's measured peak is at or under its budget and
close to its prediction, and the batch keep-everything cannot hold trains under ``run --fake``."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_gpu_acceptance_run_passes_under_the_emulation(tmp_path):
    out = tmp_path / "gpu"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = json.loads((out / "results.json").read_text())["steps"]
    assert not [k for k in steps if k.endswith(":error")], {k: v for k, v in steps.items() if k.endswith(":error")}
    rows = steps["gpt2"]["rows"] + steps["gpt2_bf16"]["rows"]
    assert len(rows) >= 12
    for row in rows:
        measured, predicted, budget = row["measured_peak_bytes"], row["predicted_peak_bytes"], row["budget_bytes"]
        assert measured > 0
        if budget is not None:
            assert measured <= budget, row["label"]
        if predicted is not None:  # issue #20's target, fused steps included
            assert abs(measured - predicted) <= 0.005 * predicted, (row["label"], predicted, measured)
    report = steps["does_not_fit"]
    assert report["measured_peak_bytes"] <= report["budget_bytes"]
    assert (out / "section.md").read_text().startswith("### CUDA")


def _gpu_script():
    """benchmarks/gpu.py as a module (its pure parts: the peers step's sizes, budgets, parsing and table)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_script", ROOT / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_peers_step_counts_the_llamas_it_trains_and_reads_its_workers():
    """The budget below the model states is computed from the shape before any model exists: the count must be
    transformers' own (TinyLlama's 1,100,048,384 parameters); a worker's result is its marked line, and a
    worker that died is one line; memplan's budgets include the least peak a peer measured, named."""
    from transformers import LlamaConfig, LlamaForCausalLM

    gpu = _gpu_script()
    for name, shape in gpu.PEER_SHAPES.items():
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**shape, use_cache=False))
        assert gpu.llama_param_count(shape) == sum(p.numel() for p in model.parameters()), name
    assert gpu.llama_param_count(gpu.PEER_SHAPES["1.1b"]) == 1_100_048_384
    assert gpu.model_states_bytes(gpu.PEER_SHAPES["3b"]) == 12 * gpu.llama_param_count(gpu.PEER_SHAPES["3b"])

    ok = gpu.parse_worker(f"noise\n{gpu.PEER_MARK}" + json.dumps({"measured_peak_bytes": 5}) + "\n", "", 0)
    assert ok == {"measured_peak_bytes": 5}
    died = gpu.parse_worker("", "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory\n", 1)
    assert died == {"error": "exit 1: torch.OutOfMemoryError: CUDA out of memory"}
    assert gpu.parse_worker("", "", -9) == {"error": "exit -9, no output"}

    shape = gpu.PEER_SHAPES["1.1b"]
    rows = [{"label": "torchao", "peer": "torchao", "measured_peak_bytes": 9e9, "step_s": 2.0},
            {"label": "fsdp2", "peer": "fsdp2", "measured_peak_bytes": 7e9, "step_s": 3.0},
            {"label": "deepspeed", "peer": "deepspeed", "error": "ModuleNotFoundError: No module named 'deepspeed'"}]
    budgets = gpu.peer_budgets(shape, rows)
    assert budgets == [(int(0.75 * gpu.model_states_bytes(shape)), "75% of the model states"),
                       (7e9, "fsdp2's measured peak")]
    assert budgets[0][0] < gpu.model_states_bytes(shape)
    assert gpu.peer_budgets(shape, rows[2:]) == budgets[:1]
    table = gpu.peer_table(rows + [{"label": "memplan", "budget_bytes": 7e9, "measured_peak_bytes": 6.9e9,
                                    "predicted_peak_bytes": 6.9e9, "step_s": 1.05, "predicted_step_s": 1.0}])
    assert len(table) == 2 + 4 and "`ModuleNotFoundError" in table[4]
    assert table[5].endswith("| 1.05 s | 1.00 s | +5.0% |") and "+0.0%" in table[5]


def test_the_peers_steps_memplan_run_measures_at_its_prediction_under_the_emulation():
    """The memplan run of ``--only peers`` (what a GPU session spends its minutes on), in this process at the
    smoke shape: each budget's plan applied and measured, the measured peak at the prediction and under the
    budget; a budget no plan fits is its one-line row."""
    from memplan.planner.probe.device import emulate_cuda

    gpu = _gpu_script()
    shape = gpu.PEER_SHAPES["smoke"]
    budgets = gpu.peer_budgets(shape, []) + [(10_000, "a budget nothing fits")]
    with emulate_cuda():
        out = gpu._peer_worker({"peer": "memplan", "shape": "smoke", "seq_len": 32, "steps": 3, "smoke": True,
                                "budgets": budgets, "solve_s": 5})
    first, refused = out["runs"]
    assert first["measured_peak_bytes"] <= first["budget_bytes"] < gpu.model_states_bytes(shape)
    assert abs(first["measured_peak_bytes"] - first["predicted_peak_bytes"]) <= 0.005 * first["predicted_peak_bytes"]
    assert first["step_s"] > 0 and len(first["step_times_s"]) == 2 and "stepped on the host" in first["label"]
    assert refused["error"].startswith("Infeasible") and "\n" not in refused["error"]
    assert out["keep_all_predicted_peak_bytes"] > gpu.model_states_bytes(shape)
