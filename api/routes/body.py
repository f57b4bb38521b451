"""Request bodies read off the event loop: a dependency per request model, and its OpenAPI entry.

FastAPI would parse and validate a body on the event loop, where a maximal graph (tens of MB, a hundred
thousand ops) takes seconds during which nothing else is answered, ``/healthz`` included; a thread would
not help, as pydantic-core holds the GIL while it parses. So the bytes go to a parse worker process
(``Service.parsers``), which validates them with the request model
(:func:`memplan.api.schemas.read_request`) and sends back the fields and the graph's canonical JSON. A
refusal is the same ``RequestValidationError`` FastAPI raises, so it is answered the same way
(:mod:`memplan.api.errors`). The route documents the body with :func:`documented`, so the schema still
says exactly what the model accepts.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from memplan.api.schemas import ReadRequest
from memplan.api.service import Service, get_service

M = TypeVar("M", bound=BaseModel)


async def read_body(service: Service, model: type[M], body: bytes) -> ReadRequest[M]:
    """``body`` read as ``model`` by a parse worker (:meth:`Service.read_body`); raises
    ``RequestValidationError`` (answered 422 like FastAPI's own) or :class:`LimitExceeded`."""
    return await service.read_body(model, body)


def json_body(model: type[M]) -> Callable[[Request], Awaitable[ReadRequest[M]]]:
    """A FastAPI dependency: the request's body read as ``model`` by a parse worker."""

    async def read(request: Request) -> ReadRequest[M]:
        return await read_body(get_service(request), model, await request.body())

    return read


def documented(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose body ``model`` is read by :func:`json_body` (the model's schema
    is added to the components by ``memplan.api.app``)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}
