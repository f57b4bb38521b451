"""Several ranks from the command line: ``--fake --nproc N`` traced in this process, and ``run --nproc N``
trained on N processes of this machine."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from memplan.api.cli.base import emit_json, out, working
from memplan.api.cli.options import (
    workload_options,
)
from memplan.planner.core.errors import MemplanError


def _free_loopback_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ranks_fake(workload: str, *, nproc: int, engine: str, budget: str | None, solver: str, time_limit: float,
                options: list[str] | None, json_out: bool) -> None:
    """``--fake --nproc N``: every rank's traced and predicted peak in this process (nothing trained):
    :func:`memplan.api.distributed.plan_ranks_fake`."""
    from memplan.api.distributed import format_rows, plan_ranks_fake
    from memplan.planner.probe.distributed import ENGINES

    if engine not in ENGINES:
        raise MemplanError(f"--engine {engine!r}: choose {' or '.join(ENGINES)}")
    with working(f"tracing {nproc} {engine} ranks under the fake process group", quiet=json_out):
        rows = plan_ranks_fake(workload, world_size=nproc, engine=engine, budget=budget, solver=solver,
                               time_limit_s=time_limit, workload_options=workload_options(options))
    if json_out:
        emit_json({"workload": workload, "engine": engine, "world_size": nproc, "fake": True, "ranks": rows})
    else:
        out.print(format_rows(rows))


def _dist_worker(rank: int, world: int, port: int, kwargs: dict[str, Any], result_path: str) -> None:
    """One rank of ``memplan run --nproc``: torchrun's environment, then :func:`run_distributed`. Rank 0
    writes the rows (or the one-line error) to ``result_path``; every rank's MemplanError is reported."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import torch.distributed as dist

    from memplan.api.distributed import run_distributed

    try:
        rows = run_distributed(**kwargs)
    except MemplanError as e:
        Path(f"{result_path}.{rank}").write_text(json.dumps({"error": f"rank {rank}: {e}"}))
        # exit non-zero at once: the parent then stops the other ranks, which may be waiting for this one
        # in a collective (rank 0 solves while the others wait for its plan)
        os._exit(3)
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank == 0:
        Path(f"{result_path}.{rank}").write_text(json.dumps({"rows": rows}))
    # leave without the interpreter's finalization: gloo's worker threads can still hold work whose tensors
    # reference Python objects, and tearing them down then aborts the process (SIGABRT, "terminate called
    # without an active exception"; pytorch/pytorch#179291) after the rank has done all its work
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def train_ranks(workload: str, *, nproc: int, engine: str, budget: str, solver: str, fuse: str | None,
                     steps: int, time_limit: float, options: list[str] | None, json_out: bool,
                     unsupported: dict[str, bool]) -> None:
    """``memplan run --nproc N``: N processes on this machine, one rank each (what ``torchrun
    --nproc-per-node N -m memplan.api.distributed`` does, without torchrun)."""
    import logging
    import tempfile

    import torch.multiprocessing as mp

    # stopping the other ranks after one failed is expected here; the failure itself is reported below
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)

    from memplan.api.distributed import format_rows
    from memplan.planner.probe.distributed import ENGINES

    given = [flag for flag, on in unsupported.items() if on]
    if given:
        raise MemplanError(f"memplan run --nproc {nproc} does not take {', '.join(given)} yet: distributed runs "
                           f"profile, solve (recompute plans) and train on every rank themselves")
    if engine not in ENGINES:
        raise MemplanError(f"--engine {engine!r}: choose {' or '.join(ENGINES)}")
    kwargs = {"workload": workload, "budget": budget, "engine": engine, "steps": steps, "solver": solver,
              "fuse": fuse, "time_limit_s": time_limit, "workload_options": workload_options(options)}
    with tempfile.TemporaryDirectory(prefix="memplan-run-") as tmp:
        result = os.path.join(tmp, "result")
        with working(f"training on {nproc} processes ({engine})", quiet=json_out):
            try:
                mp.start_processes(_dist_worker, args=(nproc, _free_loopback_port(), kwargs, result),
                                   nprocs=nproc, start_method="spawn")
                failed = None
            except mp.ProcessRaisedException as e:  # not a MemplanError: a bug, but say which rank
                failed = str(e).strip().splitlines()[-1]
            except mp.ProcessExitedException as e:
                failed = f"a rank exited with code {e.exit_code}"
        answers = [json.loads(Path(tmp, name).read_text()) for name in sorted(os.listdir(tmp))]
    errors = [a["error"] for a in answers if "error" in a]
    if errors:
        raise MemplanError(errors[0])
    if failed is not None or not answers:
        raise MemplanError(f"distributed run failed: {failed or 'rank 0 wrote no result'}")
    rows = answers[0]["rows"]
    if json_out:
        emit_json({"workload": workload, "engine": engine, "world_size": nproc, "ranks": rows})
        return
    out.print(format_rows(rows))
