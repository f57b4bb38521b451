"""The loop a worker process of the solve pool runs (the server's side is :mod:`memplan.api.pool`).

A worker imports memplan's core and its solvers only (no FastAPI), caps its own address space, says it
is ready, then answers one job at a time over its pipe: ``(fn, args, kwargs)`` in, ``("ok", result)``,
``("error", exception)`` or ``("memory", None)`` out. The server stops a job that overruns by killing
the process, so nothing here needs to watch the clock.
"""

from __future__ import annotations

import resource
import signal
from multiprocessing.connection import Connection
from typing import Any

READY = "ready"


def main(conn: Connection, memory_bytes: int) -> None:
    """Serve jobs from ``conn`` until it closes or sends None. ``memory_bytes`` > 0 caps the address space
    (``RLIMIT_AS``): an allocation past it raises ``MemoryError`` in the job instead of swapping the
    machine."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C at the server's terminal is the server's to handle
    from memplan.api import jobs

    jobs.warm_up()  # import and register the solvers before the cap (their libraries map memory once)
    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    conn.send((READY, None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the server went away
            return
        if message is None:
            return
        fn, args, kwargs = message
        reply: tuple[str, Any]
        try:
            reply = ("ok", fn(*args, **kwargs))
        except MemoryError:
            reply = ("memory", None)
        except Exception as e:  # noqa: BLE001 - every failure goes back to the server, which maps it
            reply = ("error", e)
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return
        except Exception as e:  # noqa: BLE001 - an exception that does not pickle: send its text
            conn.send(("error", RuntimeError(f"{type(reply[1]).__name__}: {reply[1]} ({e})")))
        if reply[0] == "memory":
            return  # a job that ran out of memory may have left the heap fragmented: start afresh
