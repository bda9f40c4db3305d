"""What the OpenAPI document says beyond the request and response models.

Errors: the server answers invalid requests with 400 and an OpenAI-style body, never FastAPI's
422, so each route lists the statuses it can answer and the 422 FastAPI adds is dropped.
Streaming: with `stream: true` the 200 is `text/event-stream`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from service.api.protocol import ErrorResponse

ERROR_DESCRIPTIONS = {
    400: "Invalid request: OpenAI-style error body naming the parameter",
    401: "Missing or wrong API key (only when BLOCKSERVE_API_KEY is set)",
    404: "Unknown model",
    413: "Request body over BLOCKSERVE_MAX_REQUEST_BODY_BYTES",
    500: "The generation failed on the server",
    503: "No model available: the scheduler is unreachable or not ready",
}
# OpenAPI 3.1 (as Schemathesis reads it): the schema of a text/event-stream describes one event.
SSE_EVENT_SCHEMA = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string", "description": "A chunk as JSON, an error object, or `[DONE]` (the last event)"},
    },
}
SSE_DESCRIPTION = (
    "The whole result as JSON; with `stream: true`, server-sent events instead: one `data: <chunk JSON>` "
    'line per chunk, an `{"error": ...}` event if it fails after the start, then `data: [DONE]`.'
)


def errors(*status_codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[code]} for code in status_codes}


def generation_responses() -> dict[int | str, dict[str, Any]]:
    """A completion route: JSON or an SSE stream, and every error it can answer."""
    streamed = {"content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}}, "description": SSE_DESCRIPTION}
    return {200: streamed, **errors(400, 401, 404, 413, 500, 503)}


def install_openapi(app: FastAPI) -> None:
    """Generate the document once, without FastAPI's 422 answers and their schemas."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                summary=app.summary,
                routes=app.routes,
                description=app.description,
            )
            for operations in schema["paths"].values():
                for operation in operations.values():
                    operation["responses"].pop("422", None)
            for unused in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(unused, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
