"""The REST service: ``create_app(settings)`` builds a FastAPI app (OpenAPI docs at ``/docs``).

Run it with ``memplan serve`` (uvicorn), or ``uvicorn --factory memplan.api.app:create_app_from_env``.
Routes live in ``api/routes/`` (one router per resource), the work behind them in ``api/service.py``,
the worker functions in ``api/jobs.py``, and the mapping of errors to HTTP in ``api/errors.py``.
"""

from __future__ import annotations

import functools
import hmac
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from memplan.api import errors
from memplan.api.errors import error_body
from memplan.api.routes import frontier, health, maxbatch, plan_jobs, plans, simulate, solvers
from memplan.api.schemas import FrontierRequest, PlanRequest, SimulateRequest
from memplan.api.service import Service, memplan_version
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
    for module in (plans, plan_jobs, simulate, frontier, solvers, health, maxbatch):
        app.include_router(module.router)
    app.openapi = functools.partial(_openapi, app, settings)  # type: ignore[method-assign]
    # Added last runs first: the Host check, then the token, then the body's size.
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    if settings.token:
        app.add_middleware(BearerToken, token=settings.token)
    hosts = [h.strip() for h in settings.allowed_hosts.split(",") if h.strip()]
    if hosts and "*" not in hosts:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=hosts)
    return app


REQUEST_MODELS = (PlanRequest, SimulateRequest, FrontierRequest, maxbatch.MaxBatchRequest)
"""Read by ``memplan.api.routes.body`` in a thread, so FastAPI does not see them: added to the schema here."""


def _openapi(app: FastAPI, settings: Settings) -> dict[str, Any]:
    """FastAPI's OpenAPI document, with the request models' schemas (validation mode) in its components
    and, when a token is set, the bearer scheme every route but ``/healthz`` requires."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    _, defs = models_json_schema([(m, "validation") for m in REQUEST_MODELS],
                                 ref_template="#/components/schemas/{model}")
    for name, definition in defs.get("$defs", {}).items():
        if name in components and _plain(components[name]) != _plain(definition):
            raise RuntimeError(f"OpenAPI: two schemas named {name!r} (a request's and a response's)")
        components[name] = definition
    if settings.token:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, operations in schema["paths"].items():
            if path not in BearerToken.OPEN_PATHS:
                for operation in operations.values():
                    operation["security"] = [{"bearer": []}]
                    operation.setdefault("responses", {})["401"] = {
                        "description": "no bearer token, or not this server's",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}}
    app.openapi_schema = schema
    return schema


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


class BearerToken:
    """Require ``Authorization: Bearer <token>`` on every route but ``/healthz`` (401 without it).

    For a server shared by a team: the token is compared in constant time; ``/healthz`` stays open so
    that a load balancer or a supervisor can probe it.
    """

    OPEN_PATHS = ("/healthz",)

    def __init__(self, app: ASGIApp, token: str):
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        detail = ("this server requires a token: send 'Authorization: Bearer <token>'" if not given
                  else "the bearer token is not this server's")
        body = json.dumps(error_body(detail, "unauthorized")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def _plain(schema: Any) -> Any:
    """A schema without what FastAPI's and pydantic's renderings differ in (``default: null``, 0.0 for 0)."""
    if isinstance(schema, dict):
        return {k: _plain(v) for k, v in schema.items() if not (k == "default" and v is None)}
    if isinstance(schema, list):
        return [_plain(v) for v in schema]
    return int(schema) if isinstance(schema, float) and schema.is_integer() else schema


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: wait for the disconnect, as the server would say

    return replay
