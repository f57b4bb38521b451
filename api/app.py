"""The REST service: ``create_app(settings)`` builds a FastAPI app (OpenAPI docs at ``/docs``).

Run it with ``memplan serve`` (uvicorn), or ``uvicorn --factory memplan.api.app:create_app_from_env``.
Routes live in ``api/routes/`` (one router per resource), the work behind them in ``api/service.py``,
the worker functions in ``api/jobs.py``, and the mapping of errors to HTTP in ``api/errors.py``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from memplan.api import errors
from memplan.api.errors import error_body
from memplan.api.routes import frontier, health, maxbatch, plans, simulate, solvers
from memplan.api.service import BODY_KEY, Service, memplan_version
from memplan.api.settings import Settings


def create_app(settings: Settings | None = None) -> FastAPI:
    """A new app with its own worker pool and plan cache (started in its lifespan)."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service = Service(settings)
        await service.start()
        app.state.service = service
        try:
            yield
        finally:
            service.close()

    app = FastAPI(
        title="memplan", version=memplan_version(), lifespan=lifespan,
        description="Plan what to keep, recompute or offload so a PyTorch training step fits a memory budget. "
                    "Graphs and plans travel in memplan's file formats (memplan.graph/1, memplan.plan/1).")
    app.state.settings = settings
    errors.install(app)
    for module in (plans, simulate, frontier, solvers, health, maxbatch):
        app.include_router(module.router)
    app.add_middleware(PlanCacheShortcut)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)  # the outer one: runs first
    return app


def create_app_from_env() -> FastAPI:
    """For ``uvicorn --factory``: settings from ``MEMPLAN_*`` environment variables."""
    return create_app(Settings.from_env())


class BodySizeLimit:
    """Refuse request bodies over ``max_bytes`` with 413 naming the limit, before anything parses them.

    A declared ``Content-Length`` over the limit is refused unread; otherwise the body is read (at most
    ``max_bytes`` of it) and handed on whole, so a chunked upload cannot get around the limit.
    """

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.strip().isdigit() or int(declared) > self.max_bytes):
            await self._refuse(send, f"request body is {declared.decode('latin-1')} bytes")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send, "request body is larger")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, send: Send, what: str) -> None:
        body = json.dumps(error_body(
            f"{what}; this server accepts at most {self.max_bytes} bytes (max_body_bytes)", "limit_exceeded",
            limit="max_body_bytes", limit_value=self.max_bytes)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class PlanCacheShortcut:
    """Answer a repeated ``POST /v1/plans`` from the plan cache before its body is parsed.

    Parsing and validating a graph costs milliseconds; a client that repeats a request sends the same
    bytes. The body's hash (with its content type) is mapped to the plan cache key when the request is
    first answered (:meth:`Service.plan`); the same bytes again are answered from the cache directly.
    Anything else (another body, a key not in the cache: a timed-out answer) goes the normal way.
    """

    PATH = "/v1/plans"

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.PATH:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:  # the body is already whole and within its limit (BodySizeLimit): usually one message
            message = await receive()
            if message["type"] != "http.request":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        content_type = dict(scope.get("headers") or []).get(b"content-type", b"")
        body_key = hashlib.sha256(content_type + b"\0" + body).hexdigest()
        service = getattr(scope["app"].state, "service", None)
        answer = service.cached_by_body(body_key) if service is not None else None
        if answer is not None:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(answer)).encode())]})
            await send({"type": "http.response.body", "body": answer})
            return
        scope = {**scope, BODY_KEY: body_key}
        await self.app(scope, _replay(body, receive), send)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: wait for the disconnect, as the server would say

    return replay
