"""Prove it where it matters (issue #21.5): a process that cannot allocate the keep-everything step trains
under ``memplan run --fake --budget``.

A child process imports what it needs, then caps its own address space (``RLIMIT_AS``) at what it maps
now plus ``ALLOWANCE``: the budget and a margin for what is not the step (the profile's Python objects,
one op's timing). glibc is told to serve every large block by ``mmap`` and to keep one arena
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_ARENA_MAX``), so freed memory leaves the address space at once and
the cap counts live bytes. Under the same cap, plain training fails to allocate (checked, so the cap is
real) and ``memplan run --fake`` profiles, plans and trains, its measured peak and its profiling peak
within the budget.
"""

import json
import os
import subprocess
import sys

import pytest

MiB = 2**20
WORKLOAD = {"depth": 24, "width": 64, "batch_size": 32768}  # keep-everything about 233 MiB
BUDGET = 96 * MiB
ALLOWANCE = BUDGET + 64 * MiB

CHILD = '''
import json, resource, sys
import torch
torch.set_num_threads(1)
import memplan.api.cli as cli
import memplan.executor.session, memplan.planner.probe.profiler, memplan.solvers  # noqa: F401
from memplan.planner.core.errors import MemplanError
from memplan.planner.workloads import default_optimizer, load_workload, training_step

x = torch.randn(64, 64, requires_grad=True)  # lazy initialisations (autograd, the profiler) before the cap
(x @ x).sum().backward()
with torch.profiler.profile(profile_memory=True):
    torch.ones(3) + 1


def mapped_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def status(key):
    with open("/proc/self/status") as f:
        return next(line.split(":")[1].strip() for line in f if line.startswith(key + ":"))


mode, allowance, options = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
cap = mapped_bytes() + allowance
resource.setrlimit(resource.RLIMIT_AS, (cap, resource.RLIM_INFINITY))
# for a failure's message: what the address space held when the child ended (threads' stacks count)
import atexit
atexit.register(lambda: print(f"[child: cap {cap >> 20} MiB, VmSize {status('VmSize')}, VmPeak "
                              f"{status('VmPeak')}, threads {status('Threads')}, CUDA build "
                              f"{torch.version.cuda}]", file=sys.stderr))
if mode == "plain":
    w = load_workload("mlp", **options)
    try:
        training_step(w.model, w.batch, w.loss_fn, default_optimizer(w.model))
    except (RuntimeError, MemoryError, MemplanError) as e:
        print("cannot allocate" if "can't allocate memory" in str(e) else f"failed otherwise: {e}")
    else:
        print("trained")
else:
    sets = [a for k, v in options.items() for a in ("--set", f"{k}={v}")]
    sys.argv = ["memplan", "run", "mlp", "--fake", *sys.argv[4:], *sets]
    cli.main()
'''


def _child(tmp_path, mode, *args):
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1",
           "MEMPLAN_CACHE_DIR": str(tmp_path)}
    return subprocess.run([sys.executable, "-c", CHILD, mode, str(ALLOWANCE), json.dumps(WORKLOAD), *args],
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/status are Linux's")
def test_a_step_that_cannot_be_allocated_trains_under_the_plan(tmp_path):
    plain = _child(tmp_path, "plain")
    assert plain.stdout.strip() == "cannot allocate", plain.stdout + plain.stderr[-2000:]

    # greedy: the cap is on the whole process's address space, where a solver's own memory counts too (the
    # ILP's and the hierarchical DP's CP-SAT and HiGHS map hundreds of MB); on a GPU the budget is device
    # memory, which no solver touches
    run = _child(tmp_path, "run", "--budget", str(BUDGET), "--steps", "1", "--solver", "greedy", "--time-limit",
                 "10", "--json")
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    doc = json.loads(run.stdout)
    assert doc["keep_all_predicted_peak_bytes"] > ALLOWANCE  # the step without a plan cannot fit here
    assert doc["replays_per_step"] > 0
    assert doc["measured_peak_bytes"] <= BUDGET and doc["profile_peak_bytes"] <= BUDGET
