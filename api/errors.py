"""memplan's errors mapped to HTTP: the one place the service decides a status code.

Every error body has the same shape (:class:`memplan.api.schemas.ErrorBody`): ``detail`` (one sentence
naming the culprit), ``error`` (a stable code), and, where they apply, ``field``, ``limit`` /
``limit_value`` and ``budget_bytes`` / ``min_feasible_bytes``. Anything not mapped here is a bug: it is
logged with its traceback and answered 500 without internals.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from memplan.planner.core.errors import (
    GraphError,
    Infeasible,
    MemplanError,
    PlanError,
    PlanMismatch,
    SolverUnavailable,
    WorkloadError,
)

log = logging.getLogger("memplan.api")


# ---- the service's own errors ---------------------------------------------------------------------
class LimitExceeded(MemplanError):
    """A request is over one of the server's limits (:class:`memplan.api.settings.Settings`)."""

    def __init__(self, message: str, *, limit: str, limit_value: float):
        super().__init__(message)
        self.limit = limit
        self.limit_value = limit_value


class Overloaded(MemplanError):
    """Every worker is busy and the queue is full, or no worker became free within the queue timeout."""


class SolveTimeout(MemplanError):
    """A job ran past its time limit plus the grace period (its worker process was stopped)."""


class WorkerLost(MemplanError):
    """The worker process running a job died (its replacement is started)."""


class OutOfMemory(LimitExceeded):
    """A job needed more memory than a worker may use (``worker_memory_bytes``)."""


class StoreUnavailable(MemplanError):
    """The shared plan store (PostgreSQL) cannot be reached now; retry later."""


class JobNotFound(MemplanError):
    """No job has this id (never submitted, or finished longer ago than ``job_ttl_s``)."""


class StoredAnswer(MemplanError):
    """An answer decided elsewhere (another replica's solve, a job's end), as the HTTP status and body it was
    given there: served as it is."""

    def __init__(self, status_code: int, body: bytes):
        super().__init__(f"HTTP {status_code}")
        self.status_code = status_code
        self.body = body


# ---- one table: error class -> (status, code), most specific first ----------------------------
_STATUS: list[tuple[type[BaseException], int, str]] = [
    (GraphError, 422, "graph_error"),
    (PlanMismatch, 422, "plan_mismatch"),
    (PlanError, 422, "plan_error"),
    (Infeasible, 422, "infeasible"),
    (WorkloadError, 422, "workload_error"),
    (SolverUnavailable, 503, "solver_unavailable"),
    (Overloaded, 503, "overloaded"),
    (SolveTimeout, 504, "solve_timeout"),
    (WorkerLost, 503, "worker_lost"),
    (StoreUnavailable, 503, "store_unavailable"),
    (JobNotFound, 404, "not_found"),
    (MemplanError, 422, "invalid_request"),
]


def error_body(detail: str, error: str, **extra: Any) -> dict[str, Any]:
    return {"detail": detail, "error": error, **{k: v for k, v in extra.items() if v is not None}}


TRANSIENT = (Overloaded, WorkerLost, StoreUnavailable, SolveTimeout)
"""Errors of the moment, not of the request: another try may succeed (not shared between replicas)."""


def memplan_error_response(e: MemplanError) -> Response:
    if isinstance(e, StoredAnswer):
        return Response(e.body, status_code=e.status_code, media_type="application/json",
                        headers={"Retry-After": "5"} if e.status_code == 503 else None)
    if isinstance(e, LimitExceeded):
        return JSONResponse(error_body(str(e), "limit_exceeded", limit=e.limit, limit_value=e.limit_value),
                            status_code=422)
    status, code = next((s, c) for cls, s, c in _STATUS if isinstance(e, cls))
    extra: dict[str, Any] = {}
    if isinstance(e, Infeasible):
        extra = {"budget_bytes": e.budget_bytes, "min_feasible_bytes": e.min_feasible_bytes}
    headers = {"Retry-After": "5"} if isinstance(e, (Overloaded, WorkerLost, StoreUnavailable)) else None
    return JSONResponse(error_body(str(e), code, **extra), status_code=status, headers=headers)


def error_answer(e: MemplanError) -> tuple[int, bytes]:
    """The HTTP status and body ``e`` is answered with (to store it for another replica, or a job)."""
    response = memplan_error_response(e)
    return response.status_code, bytes(response.body)


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """The first request-validation error as ``(sentence, field)``, worded like memplan's own
    ``GraphError`` / ``PlanError`` messages (``graph: ops.3.time_s: Input should be ...``)."""
    if not errors:
        return "invalid request", None
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ())]
    if loc and loc[0] in ("body", "query", "path", "header"):
        loc = loc[1:]
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if err.get("type") == "json_invalid":
        return f"request body is not valid JSON: {err.get('ctx', {}).get('error', msg)}", None
    if not loc:
        if err.get("type") == "missing":
            return "request body is missing: expected a JSON object", None
        # a model validator's own sentence names its fields already
        return (msg if err.get("type") == "value_error" else f"request body: {msg}"), None
    field = ".".join(loc)
    head, rest = loc[0], ".".join(loc[1:])
    return (f"{head}: {rest}: {msg}" if rest else f"{head}: {msg}"), field


def install(app: FastAPI) -> None:
    """Register the handlers on ``app``."""

    @app.exception_handler(MemplanError)
    async def _memplan(_: Request, e: MemplanError) -> Response:
        return memplan_error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        detail, field = validation_message(list(e.errors()))
        code = "graph_error" if field and field.split(".")[0] == "graph" else "invalid_request"
        return JSONResponse(error_body(detail, code, field=field), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return JSONResponse(error_body(str(e.detail), code), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal error ({type(e).__name__}); it has been logged", "internal_error"),
                            status_code=500)
