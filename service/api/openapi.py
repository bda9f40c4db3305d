"""What the OpenAPI document says beyond the request and response models.

Errors: the server answers invalid requests with 400 and an OpenAI-style body, never FastAPI's
422, so each route lists the statuses it can answer and the 422 FastAPI adds is dropped.
Streaming: with `stream: true` the 200 is `text/event-stream`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from service.api.protocol import ErrorResponse
from service.api.sse import DONE_EVENT

COMPONENTS = "#/components/schemas/"

ERROR_DESCRIPTIONS = {
    400: "Invalid request: OpenAI-style error body naming the parameter",
    401: "Missing or wrong API key (only when BLOCKSERVE_API_KEY is set)",
    404: "Unknown model",
    413: "Request body over BLOCKSERVE_MAX_REQUEST_BODY_BYTES",
    500: "The generation failed on the server",
    503: "No model available: the scheduler is unreachable or not ready",
}
SSE_DESCRIPTION = (
    "The whole result as JSON; with `stream: true`, server-sent events instead: one `data: <chunk JSON>` "
    'line per chunk, an `{"error": ...}` event if it fails after the start, then `data: [DONE]`.'
)


def errors(*status_codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[code]} for code in status_codes}


def sse_event_schema(chunk: type[BaseModel]) -> dict[str, Any]:
    """One event of the stream (in OpenAPI 3.1 the schema of a text/event-stream describes one event)."""
    payload = {"anyOf": [{"$ref": COMPONENTS + chunk.__name__}, {"$ref": COMPONENTS + ErrorResponse.__name__}]}
    done = DONE_EVENT.removeprefix("data: ").strip()
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"type": "string"},
            "data": {
                "anyOf": [
                    {"const": done},
                    {"type": "string", "contentMediaType": "application/json", "contentSchema": payload},
                ],
                "description": f"A chunk, or an error object if the stream fails after its start; `{done}` last",
            },
        },
    }


def generation_responses(chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """A completion route: JSON or an SSE stream of `chunk`s, and every error it can answer."""
    streamed = {"content": {"text/event-stream": {"schema": sse_event_schema(chunk)}}, "description": SSE_DESCRIPTION}
    return {200: streamed, **errors(400, 401, 404, 413, 500, 503)}


def install_openapi(app: FastAPI, stream_chunks: list[type[BaseModel]]) -> None:
    """Generate the document once, without FastAPI's 422 answers and their schemas, with the chunk schemas."""

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
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for unused in ("HTTPValidationError", "ValidationError"):
                components.pop(unused, None)
            _, chunk_schemas = models_json_schema(
                [(chunk, "serialization") for chunk in stream_chunks], ref_template=COMPONENTS + "{model}"
            )
            for name, definition in chunk_schemas["$defs"].items():
                components.setdefault(name, definition)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
