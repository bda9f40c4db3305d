"""Server-sent events the way OpenAI streams them: `data: {json}` lines, then `data: [DONE]`.

A failure after the response has started cannot change the status code any more, so it
becomes an `{"error": ...}` event before the final `[DONE]`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from service.api.errors import ApiError

log = logging.getLogger(__name__)

DONE_EVENT = "data: [DONE]\n\n"


def sse_event(payload_json: str) -> str:
    return f"data: {payload_json}\n\n"


async def with_done_event(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The events, then an error event if they failed, then [DONE]."""
    try:
        async for event in events:
            yield event
    except ApiError as exc:
        yield sse_event(json.dumps(exc.body()))
    except Exception:
        log.exception("a streamed response failed")
        yield sse_event(json.dumps(ApiError(500, "The server had an error while streaming the response.").body()))
    finally:
        await events.aclose()
    yield DONE_EVENT


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    """Stream the events; a client that leaves closes them (and so aborts their requests)."""
    stream = with_done_event(events)
    return StreamingResponse(
        stream,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        # Starlette stops iterating when the client leaves; closing the generator runs its cleanup.
        background=BackgroundTask(stream.aclose),
    )
