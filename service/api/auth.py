"""Optional API key: `Authorization: Bearer <key>` on every /v1 route (the scheme in any case).

Checked before anything else (even before the body is read), so a caller without the key
learns nothing but 401. /health, /ready and /metrics stay open for probes and scrapers, and
/docs, /redoc and /openapi.json on purpose: they describe the API, not its data, and a browser
opening /docs cannot send the key.
"""

from __future__ import annotations

import secrets

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from service.api.errors import ApiError

PROTECTED_PREFIX = "/v1"


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIX) and not self._authorized(scope):
            error = ApiError(
                401,
                "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
                error_type="invalid_request_error",
            )
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        scheme, _, credentials = Headers(scope=scope).get("authorization", "").partition(" ")
        # RFC 9110 (section 11.1): the scheme is case-insensitive, and one or more spaces follow it.
        given = credentials.lstrip(" ").encode()
        return scheme.lower() == "bearer" and secrets.compare_digest(given, self._api_key)
