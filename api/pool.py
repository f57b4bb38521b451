"""The worker pool: solves run here, off the event loop, so the server keeps answering (``/healthz``,
cache hits) while an ILP runs.

``workers`` jobs run at once; up to ``max_queue`` more wait (``Overloaded`` beyond that). A caller waits
for its job at most ``timeout_s`` (the request's time limit plus a grace period): past it the request is
answered ``SolveTimeout`` while the job, which cannot be interrupted safely, keeps its worker until it
returns (solvers honour their time limits, so this is bounded in practice).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Callable
from concurrent.futures import BrokenExecutor, Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

from memplan.api import jobs
from memplan.api.errors import Overloaded, SolveTimeout, WorkerLost

log = logging.getLogger("memplan.api")


class WorkerPool:
    def __init__(self, kind: str, workers: int, max_queue: int):
        self.kind = kind
        self.workers = workers
        self.max_queue = max_queue
        self.busy = 0
        self.queued = 0
        self._executor: Executor | None = None
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        """Create the executor and start every worker (a process pool spawns its processes now, so the
        first request does not pay for it)."""
        self._loop = asyncio.get_running_loop()
        self._slots = asyncio.Semaphore(self.workers)
        self._executor = self._new_executor()
        warm = [asyncio.wrap_future(self._executor.submit(jobs.warm_up)) for _ in range(self.workers)]
        await asyncio.gather(*warm)

    def close(self) -> None:
        if self._executor is None:
            return
        executor, self._executor = self._executor, None
        if self.busy == 0:
            executor.shutdown(wait=True)
            return
        # A job still running would keep the server from exiting: cancel the queued ones and end the
        # processes of the running ones (ProcessPoolExecutor has no public way before Python 3.14;
        # threads cannot be ended, and their jobs stop at their time limits).
        processes = list((getattr(executor, "_processes", None) or {}).values())
        executor.shutdown(wait=False, cancel_futures=True)
        for proc in processes:
            if proc.is_alive():
                proc.terminate()

    async def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` in a worker; raise what it raises."""
        if self._executor is None or self._slots is None or self._loop is None:
            raise RuntimeError("worker pool used before start() or after close()")
        if self._slots.locked() and self.queued >= self.max_queue:
            raise Overloaded(f"all {self.workers} workers are busy and {self.queued} requests are waiting "
                             f"(max_queue {self.max_queue}); retry later")
        self.queued += 1
        try:
            await self._slots.acquire()
        finally:
            self.queued -= 1
        self.busy += 1
        executor = self._executor
        try:
            future: Future[Any] = executor.submit(fn, *args, **kwargs)
        except BrokenExecutor:
            self._release()
            raise self._replace(executor) from None
        except BaseException:
            self._release()
            raise
        loop = self._loop

        def done(_: Future[Any]) -> None:
            # Runs on the executor's thread: hand the slot back on the event loop's.
            try:
                loop.call_soon_threadsafe(self._release)
            except RuntimeError:  # the loop is closed: the server is shutting down
                pass

        future.add_done_callback(done)
        try:
            # shield: a request cancelled (client gone) or timed out leaves the job to finish and free its slot.
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout_s)
        except TimeoutError:
            raise SolveTimeout(f"the job did not finish within {timeout_s:.1f} s (its time limit plus the "
                               f"server's grace period); try a smaller graph or time limit") from None
        except BrokenExecutor:
            raise self._replace(executor) from None

    def _new_executor(self) -> Executor:
        if self.kind == "process":
            # spawn, not fork: the server process has threads (the event loop's executor, OR-Tools').
            return ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        return ThreadPoolExecutor(self.workers, thread_name_prefix="memplan-solve")

    def _replace(self, broken: Executor) -> WorkerLost:
        """A worker process died (killed for memory, a crash in a native solver): a process pool is then
        unusable, so start a fresh one (once, however many jobs saw it die) and say what happened."""
        log.error("a worker process of the solve pool died; starting a new pool")
        if self._executor is broken:
            broken.shutdown(wait=False, cancel_futures=True)
            self._executor = self._new_executor()
        return WorkerLost("a worker process died while running this request (out of memory?); the pool was "
                          "restarted, retry or send a smaller graph")

    def _release(self) -> None:
        self.busy -= 1
        if self._slots is not None:
            self._slots.release()
