"""Request bodies read off the event loop: a dependency per request model, and its OpenAPI entry.

FastAPI would parse and validate a body on the event loop, where a maximal graph (tens of MB, a million
ops) takes seconds during which nothing else is answered, ``/healthz`` included. Here the bytes are
handed to a thread that parses and validates them with the request model
(:func:`memplan.api.schemas.parse_request`); a refusal is the same ``RequestValidationError`` FastAPI
raises, so it is answered the same way (:mod:`memplan.api.errors`). The route documents the body with
:func:`documented`, so the schema still says exactly what the model accepts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from memplan.api.schemas import parse_request
from memplan.api.settings import Settings

M = TypeVar("M", bound=BaseModel)


def _parse(model: type[M], body: bytes, settings: Settings | None) -> M | list[dict[str, Any]]:
    try:
        return parse_request(model, body, settings)
    except ValidationError as e:  # the first error only, worked out here too: a million of them is slow
        return [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False, include_input=False)[:1]]


def json_body(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """A FastAPI dependency: the request's body validated as ``model`` in a thread."""

    async def read(request: Request) -> M:
        body = await request.body()
        parsed = await asyncio.to_thread(_parse, model, body, getattr(request.app.state, "settings", None))
        if isinstance(parsed, list):
            raise RequestValidationError(parsed)
        return parsed

    return read


def documented(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose body ``model`` is read by :func:`json_body` (the model's schema
    is added to the components by ``memplan.api.app``)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}
