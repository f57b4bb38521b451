"""The worker pool: solves run here, off the event loop, so the server keeps answering (``/healthz``,
cache hits) while an ILP runs.

``workers`` jobs run at once; up to ``max_queue`` more wait, each at most ``queue_timeout_s``
(``Overloaded``, a 503 with Retry-After, beyond either). A job has ``timeout_s`` (its request's time
limit plus the grace period) to answer.

With ``kind="process"`` each worker is a process of its own (:mod:`memplan.api.worker`) that the pool
talks to over a pipe, so the pool can bound every job from outside, whatever the solver does:

* a job past its ``timeout_s`` is answered ``SolveTimeout`` and its process is killed (SIGKILL) and
  replaced by a spare process kept started for this (``spare=True``; a new spare starts in the
  background), so its place is free again at once, not after the seconds a new process takes to start;
* a worker that dies under a job (a native crash, killed by the OS) fails that job alone (``WorkerLost``)
  and is replaced; one found dead while idle is replaced before it is given a job;
* a worker's address space is capped (``memory_bytes``): a job past it is ``OutOfMemory`` (422 naming
  ``worker_memory_bytes``) and the worker is replaced.

``kind="thread"`` runs jobs in threads of the server (cheaper to start; for tests and embedding): a thread
cannot be stopped, so a job past its ``timeout_s`` is answered ``SolveTimeout`` but keeps its worker
until it returns.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from memplan.api import worker as worker_loop
from memplan.api.errors import OutOfMemory, Overloaded, SolveTimeout, WorkerLost

log = logging.getLogger("memplan.api")

_START_TIMEOUT_S = 120.0  # a new worker imports the solvers; on a loaded 2-core machine that takes seconds
_RETRY_AFTER_S = 5


@dataclass(eq=False)
class _Worker:
    """One worker process and the server's end of its pipe."""

    process: BaseProcess
    conn: Connection

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class WorkerPool:
    def __init__(self, kind: str, workers: int, max_queue: int, *, queue_timeout_s: float = 30.0,
                 memory_bytes: int = 0, spare: bool = False):
        self.kind = kind
        self.workers = workers
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.memory_bytes = memory_bytes
        self.busy = 0
        """Jobs running now."""
        self.queued = 0
        """Requests waiting for a worker."""
        self.replaced = 0
        """Worker processes replaced so far (killed for overrunning, dead, out of memory)."""
        self.spare = spare and kind == "process"
        self._standby: _Worker | None = None  # the spare process, started, waiting to replace a worker
        self._idle: asyncio.Queue[_Worker | None] | None = None  # thread kind: None tokens
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()  # guards _all (the pipe threads add and remove workers)
        self._executor: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # ---- life -----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every worker (processes are spawned now, so the first request does not wait for them)."""
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Queue()
        if self.kind == "thread":
            self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="memplan-solve")
            from memplan.api import jobs

            await self._loop.run_in_executor(self._executor, jobs.warm_up)
            for _ in range(self.workers):
                self._idle.put_nowait(None)
            return
        # one thread per running job (it waits on the pipe) and per replacement being started
        self._executor = ThreadPoolExecutor(2 * self.workers, thread_name_prefix="memplan-pipe")
        started = await asyncio.gather(*(self._loop.run_in_executor(self._executor, self._spawn)
                                         for _ in range(self.workers)))
        for w in started:
            self._idle.put_nowait(w)
        if self.spare:
            self._standby = await self._loop.run_in_executor(self._executor, self._spawn)

    def close(self) -> None:
        """Stop every worker (a job still running is killed: the server is going away)."""
        if self._executor is None:
            return
        self._closed = True
        executor, self._executor = self._executor, None
        with self._lock:
            workers, self._all = list(self._all), set()
        for w in workers:
            try:
                w.conn.send(None)  # an idle worker returns at once
            except OSError:
                pass
        for w in workers:
            w.process.join(timeout=0.5)
            w.kill()
        executor.shutdown(wait=self.kind == "thread" and self.busy == 0, cancel_futures=True)

    @property
    def ready(self) -> int:
        """Workers waiting for a job now."""
        return 0 if self._idle is None else self._idle.qsize()

    # ---- jobs -----------------------------------------------------------------------------------
    async def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` in a worker; return what it returns, raise what it raises (or
        ``Overloaded``, ``SolveTimeout``, ``WorkerLost``, ``OutOfMemory``)."""
        if self._executor is None or self._idle is None or self._loop is None:
            raise RuntimeError("worker pool used before start() or after close()")
        if self._idle.empty() and self.queued >= self.max_queue:
            raise Overloaded(f"all {self.workers} workers are busy and {self.queued} requests are waiting "
                             f"(max_queue {self.max_queue}); retry later")
        self.queued += 1
        try:
            worker = await asyncio.wait_for(self._idle.get(), self.queue_timeout_s)
        except TimeoutError:
            raise Overloaded(f"all {self.workers} workers stayed busy for {self.queue_timeout_s:g} s "
                             f"(queue_timeout_s); retry later") from None
        finally:
            self.queued -= 1
        self.busy += 1
        if worker is None:
            return await self._run_in_thread(fn, args, kwargs, timeout_s)
        answer: asyncio.Future[tuple[str, Any]] = self._loop.create_future()
        self._executor.submit(self._run_in_process, worker, (fn, args, kwargs), timeout_s, answer)
        # shield: a request that goes away (client gone) leaves the job to end and its worker to come back
        kind, value = await asyncio.shield(answer)
        if kind == "ok":
            return value
        if kind == "error":
            raise value
        if kind == "memory":
            raise OutOfMemory(f"the job needed more than the {self.memory_bytes / 2**30:.3g} GiB a worker may "
                              f"use (worker_memory_bytes); try a smaller graph or another solver",
                              limit="worker_memory_bytes", limit_value=self.memory_bytes)
        if kind == "timeout":
            raise SolveTimeout(f"the job did not finish within {timeout_s:.1f} s (its time limit plus the "
                               f"server's grace period) and was stopped; try a smaller graph or time limit")
        raise WorkerLost(f"the worker process running this request died ({value}); it is being replaced, "
                         f"retry or send a smaller graph")

    async def _run_in_thread(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                             timeout_s: float) -> Any:
        assert self._executor is not None and self._loop is not None
        future: Future[Any] = self._executor.submit(fn, *args, **kwargs)
        loop = self._loop

        def done(_: Future[Any]) -> None:  # on the executor's thread: give the slot back on the loop's
            try:
                loop.call_soon_threadsafe(self._give_back, None)
            except RuntimeError:  # the loop is closed: the server is shutting down
                pass

        future.add_done_callback(done)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout_s)
        except TimeoutError:
            raise SolveTimeout(f"the job did not finish within {timeout_s:.1f} s (its time limit plus the "
                               f"server's grace period); try a smaller graph or time limit") from None

    def _run_in_process(self, worker: _Worker, job: tuple[Any, ...], timeout_s: float,
                        answer: asyncio.Future[tuple[str, Any]]) -> None:
        """On a pipe thread: hand ``job`` to ``worker``, wait for its reply at most ``timeout_s``, answer,
        then give the worker (or its replacement) back to the pool."""
        reply: tuple[str, Any] = ("lost", "it could not be started")
        try:
            if not worker.process.is_alive():  # died while idle: replace it before it is given a job
                log.warning("worker process %s died while idle (exit code %s); starting another",
                            worker.process.pid, worker.process.exitcode)
                replacement = self._replace(worker)
                if replacement is None:
                    return
                worker = replacement
            reply = self._exchange(worker, job, timeout_s)
        finally:
            self._answer(answer, reply)  # whatever happened, the request gets its answer
        if reply[0] in ("ok", "error"):
            self._loop_call(self._give_back, worker)
            return
        if reply[0] == "timeout":
            log.warning("worker process %s overran its job's %.1f s; killed and replaced", worker.process.pid,
                        timeout_s)
        elif reply[0] == "lost":
            log.error("worker process %s died under a job (%s); starting another", worker.process.pid, reply[1])
        replacement = self._replace(worker)
        if replacement is not None:
            self._loop_call(self._give_back, replacement)

    @staticmethod
    def _exchange(worker: _Worker, job: tuple[Any, ...], timeout_s: float) -> tuple[str, Any]:
        try:
            worker.conn.send(job)
            return worker.conn.recv() if worker.conn.poll(timeout_s) else ("timeout", None)
        except (EOFError, OSError) as e:  # the process died under the job
            worker.process.join(timeout=1)
            code = worker.process.exitcode
            return "lost", f"exit code {code}" if code is not None else type(e).__name__
        except Exception as e:  # noqa: BLE001 - a job that does not pickle, a reply that does not unpickle
            return "error", e

    def _answer(self, answer: asyncio.Future[tuple[str, Any]], reply: tuple[str, Any]) -> None:
        def deliver() -> None:
            self.busy -= 1
            if not answer.done():
                answer.set_result(reply)

        self._loop_call(deliver)

    def _loop_call(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass

    def _give_back(self, worker: _Worker | None) -> None:
        if self.kind == "thread":
            self.busy -= 1
        if self._idle is not None and not self._closed:
            self._idle.put_nowait(worker)

    # ---- processes ------------------------------------------------------------------------------
    def _spawn(self) -> _Worker:
        """A new worker process, once it has imported the solvers and said it is ready."""
        # spawn, not fork: the server process has threads (the event loop's executor, OR-Tools').
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        process = ctx.Process(target=worker_loop.main, args=(theirs, self.memory_bytes), daemon=True,
                              name="memplan-worker")
        process.start()
        theirs.close()
        w = _Worker(process, ours)
        if not (ours.poll(_START_TIMEOUT_S) and ours.recv()[0] == worker_loop.READY):
            w.kill()
            raise RuntimeError(f"a worker process did not start within {_START_TIMEOUT_S:g} s")
        with self._lock:
            if not self._closed:
                self._all.add(w)
                return w
        w.kill()
        raise RuntimeError("the pool was closed while a worker process started")

    def _replace(self, worker: _Worker) -> _Worker | None:
        """Kill ``worker`` (if it still runs) and put another in its place: the spare when one is ready
        (a new spare is then started in the background), else a new process; None when the pool is
        closing, or when three starts in a row failed (logged: the pool then has one worker fewer)."""
        worker.kill()
        with self._lock:
            self._all.discard(worker)
            standby, self._standby = self._standby, None
        self.replaced += 1
        executor = self._executor
        if standby is not None and standby.process.is_alive() and executor is not None:
            executor.submit(self._start_spare)
            return standby
        if standby is not None:  # the spare died meanwhile
            standby.kill()
        for attempt in range(3):
            if self._closed:
                return None
            try:
                return self._spawn()
            except (OSError, RuntimeError, EOFError) as e:
                if not self._closed:
                    log.error("starting a worker process failed (attempt %d of 3): %s", attempt + 1, e)
        return None

    def _start_spare(self) -> None:
        """On a pipe thread: start a new spare process (after the last one took a worker's place)."""
        try:
            w = self._spawn()
        except (OSError, RuntimeError, EOFError) as e:
            if not self._closed:
                log.error("starting a spare worker process failed: %s", e)
            return
        with self._lock:
            if self._standby is None and not self._closed:
                self._standby = w
                return
            self._all.discard(w)
        w.kill()
