"""Fixtures shared by the test modules."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from memplan.planner.core.build import share_fused_step_bytes
from memplan.planner.core.simulator import simulate

# Pin the default device: a test not marked ``gpu`` runs on the CPU whether or not the machine has a GPU
# (subprocesses, the CLI's included, inherit it); gpu-marked tests ask for ``cuda`` by name.
os.environ["MEMPLAN_DEVICE"] = "cpu"
os.environ.pop("MEMPLAN_EMULATE_CUDA", None)


@pytest.fixture(autouse=True)
def nothing_left_active():
    """A test that leaves saved-tensor hooks or a dispatch mode active (an executor not removed after a
    refused step) fails here, naming what it left, and the state is cleared so that the tests after it run
    in a clean process instead of failing in its place."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode

    yield
    left = []
    while torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        left.append(f"saved-tensor hooks {torch._C._autograd._top_saved_tensors_default_hooks(False)[0]}")
        torch._C._autograd._pop_saved_tensors_default_hooks()
    while _get_current_dispatch_mode_stack():
        left.append(f"dispatch mode {type(_pop_mode()).__name__}")
    assert not left, f"the test left active: {'; '.join(left)}"


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the module's tests: bitwise comparisons and op timings do not depend on how
    a reduction was split across threads (modules opt in with ``pytestmark = pytest.mark.usefixtures``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class MidChainReader(torch.nn.Module):
    """An in-place chain read mid-chain: ``y`` reads ``h`` before ``relu_`` finishes it (a replay of ``y``
    re-creates ``h`` up to there, on a scratch copy); ``r += y`` finishes ``r`` from another activation."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        y = h * 3
        h.relu_()
        r = self.b(x)
        r += y
        return (h * r * y).sum()


@pytest.fixture
def mid_chain_reader():
    """The :class:`MidChainReader` class (the in-place tests and the profiler's share it)."""
    return MidChainReader


class TwoBlocks(torch.nn.Module):
    """Two linear blocks (FSDP units ``blocks.0``, ``blocks.1``) and a root parameter of the root unit's own:
    the distributed tests' toy, ``width`` -> ``hidden`` -> ``width``."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width)])
        self.scale = torch.nn.Parameter(torch.ones(width))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x * self.scale


@pytest.fixture
def two_blocks():
    """The :class:`TwoBlocks` class, for tests that build the toy at their own sizes."""
    return TwoBlocks


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serve():
    """Start ``memplan serve`` as a user does, in a subprocess on a free loopback port:
    ``serve(cache_path, env={"MEMPLAN_...": ...}, workers=2)`` returns ``(base URL, process)`` once
    ``/healthz`` answers (the test fails if the server exits or does not answer within 90 s). Every server
    started is stopped at the end of the module with Ctrl-C, as a user would stop it; one that does not
    stop within 20 s fails the test."""
    started: list[subprocess.Popen] = []

    def start(cache: Path, env: dict[str, str] | None = None, workers: int = 2) -> tuple[str, subprocess.Popen]:
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "memplan.api.cli", "serve", "--port", str(port), "--cache",
                                 str(cache), "--workers", str(workers)], env={**os.environ, **(env or {})},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"memplan serve exited with {proc.returncode}: {proc.stdout.read()}")
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    return url, proc
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"memplan serve did not answer within 90 s: {proc.stdout.read()}")
            time.sleep(0.2)

    yield start
    for proc in started:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("memplan serve did not stop on Ctrl-C within 20 s")


_TIMES = {"time_s", "backward_time_s", "time_source"}


def _structure(g):
    d = g.model_dump(exclude={"meta", "measured", "optimizer_time_s", "host_optimizer_bytes_per_s",
                              "host_optimizer_call_s"})
    d["fixed"].pop("optimizer_step_bytes")
    for f in d["fused_backward"]:  # its share of the optimizer step's transient, which differs by design
        f.pop("step_bytes")
    d["ops"] = [{k: v for k, v in op.items() if k not in _TIMES} for op in d["ops"]]
    return d


def assert_same_structure(real, fake):
    """A fake profile's graph is the real one's in every field but the times (test_fake's docstring says
    which fields differ by design): the same ops in the same order, tensors, bytes, saves, lifetimes."""
    a, b = _structure(real), _structure(fake)
    assert [op["name"] for op in a["ops"]] == [op["name"] for op in b["ops"]]
    for x, y in zip(a["ops"], b["ops"], strict=True):
        assert x == y
    for x, y in zip(a["tensors"], b["tensors"], strict=True):
        assert x == y
    assert a == b
    assert fake.meta["mutated_by"] == real.meta["mutated_by"]
    assert fake.fingerprint == real.fingerprint
    # the optimizer step's scratch differs by design (the allocator's against the storages'): the real one's
    aligned = fake.model_copy(deep=True)
    aligned.fixed.optimizer_step_bytes = real.fixed.optimizer_step_bytes
    share_fused_step_bytes(aligned)  # the storages' share; the real one adds the allocator's scratch per bucket
    extra = [f.step_bytes - g.step_bytes for f, g in zip(real.fused_backward, aligned.fused_backward, strict=True)]
    assert all(0 <= e <= 1024 for e in extra), extra  # a step call's own scratch: a few bytes
    aligned.fused_backward = [f.model_copy() for f in real.fused_backward]
    for fuse in (None, "backward"):
        assert simulate(aligned, None, fuse=fuse).peak_bytes == simulate(real, None, fuse=fuse).peak_bytes


@pytest.fixture
def same_structure():
    """:func:`assert_same_structure` (test_fake and the family matrix share it)."""
    return assert_same_structure


@pytest.fixture(scope="module")
def quick_timer(tmp_path_factory):
    """An op timer that times each distinct call once, on the module's own cache: for fake profiles whose
    graphs a test compares, not their times (the family matrices share it)."""
    from memplan.planner.probe.optime import OpTimer

    return OpTimer(torch.device("cpu"), cache_dir=tmp_path_factory.mktemp("optimes"), min_runs=1, target_s=0.0)


@pytest.fixture(scope="session")
def postgres():
    """A running throwaway PostgreSQL server (tests/pgcluster.py): its ``url``, ``stop()`` and ``start()``;
    skipped, saying so, where no server binaries are installed (``apt-get install postgresql``)."""
    from pgcluster import Cluster, server_bin

    bin_dir = server_bin()
    if bin_dir is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) found: apt-get install postgresql")
    cluster = Cluster(bin_dir)
    cluster.start()
    yield cluster
    cluster.remove()
