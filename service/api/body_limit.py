"""A cap on request bodies (BLOCKSERVE_MAX_REQUEST_BODY_BYTES), answered with 413.

A declared Content-Length over the cap is refused before any of the body is read. A body
without one (chunked) is counted as it arrives and refused at the first byte over the cap, so
the api never holds more than the cap of any one request.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.errors import ApiError

PAYLOAD_TOO_LARGE = 413


def too_large_message(max_body_bytes: int) -> str:
    return f"The request body is larger than the limit of {max_body_bytes} bytes"


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            error = ApiError(PAYLOAD_TOO_LARGE, f"{too_large_message(self.max_body_bytes)}.", param=None)
            await error.response()(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    # FastAPI passes an HTTPException from reading the body on to the error handlers.
                    raise HTTPException(PAYLOAD_TOO_LARGE, too_large_message(self.max_body_bytes))
            return message

        await self.app(scope, counting_receive, send)
