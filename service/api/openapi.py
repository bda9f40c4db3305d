"""What the OpenAPI document says beyond the request and response models.

Errors: the server answers invalid requests with 400 and an OpenAI-style body, never FastAPI's
422, so each route lists the statuses it can answer and the 422 FastAPI adds is dropped.
Streaming: with `stream: true` the 200 is `text/event-stream`.
Vocabulary: once the scheduler has named the model, token ids (marked TOKEN_ID_MARK in the request
models) are bounded by its vocabulary, so a request the document allows names no unknown token.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from service.api.protocol import TOKEN_ID_MARK, ErrorResponse
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


def decimal_at_most(maximum: int) -> str:
    """A regular expression matching the decimal numbers 0..maximum (no leading zeros), and nothing else."""
    digits = str(maximum)
    width = len(digits)
    shorter = ["[0-9]"] if width > 1 else []  # every number with fewer digits
    if width > 2:
        shorter.append(f"[1-9][0-9]{{1,{width - 2}}}")
    same_width = [digits]
    for position, digit in enumerate(map(int, digits)):
        lowest = 1 if position == 0 and width > 1 else 0
        if digit > lowest:  # the same digits before `position`, a smaller one at it, anything after
            rest = f"[0-9]{{{width - position - 1}}}" if position < width - 1 else ""
            same_width.append(f"{digits[:position]}[{lowest}-{digit - 1}]{rest}")
    return "^(" + "|".join(shorter + same_width) + ")$"


def bounded_by_vocabulary(schema: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """A copy of the document whose token ids (integers, or the text keys of logit_bias) lie below `vocab_size`."""
    bounded = copy.deepcopy(schema)
    nodes: list[Any] = [bounded]
    while nodes:
        node = nodes.pop()
        if isinstance(node, dict):
            if node.get(TOKEN_ID_MARK) is True:
                if node.get("type") == "integer":
                    node["maximum"] = vocab_size - 1
                else:
                    node["pattern"] = decimal_at_most(vocab_size - 1)
            nodes.extend(node.values())
        elif isinstance(node, list):
            nodes.extend(node)
    return bounded


def install_openapi(
    app: FastAPI, stream_chunks: list[type[BaseModel]], served_vocab_size: Callable[[], int | None]
) -> None:
    """Generate the document once, without FastAPI's 422 answers and their schemas, with the chunk schemas;
    serve it with the token ids bounded by the vocabulary of the model served, once there is one."""
    by_vocab_size: dict[int, dict[str, Any]] = {}

    def openapi() -> dict[str, Any]:
        generic = generic_openapi()
        vocab_size = served_vocab_size()
        if vocab_size is None:
            return generic
        if vocab_size not in by_vocab_size:
            by_vocab_size[vocab_size] = bounded_by_vocabulary(generic, vocab_size)
        return by_vocab_size[vocab_size]

    def generic_openapi() -> dict[str, Any]:
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
