"""Optional API keys: `Authorization: Bearer <key>` on every /v1 route (the scheme in any case).

`BLOCKSERVE_API_KEY` is one key; `BLOCKSERVE_API_KEYS` are the keys of tenants, each naming its
tenant and weight, which the request then carries (tenants.py).

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
from service.api.tenants import KEY_TENANT

PROTECTED_PREFIX = "/v1"


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: dict[str, tuple[str, float] | None]) -> None:
        """`keys`: each accepted key -> the (tenant, weight) it names, or None (the request names its own)."""
        self.app = app
        self._keys = [(key.encode(), tenant) for key, tenant in keys.items()]

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
        """Whether the request carries a known key; a tenant's key leaves its tenant in the scope's state."""
        scheme, _, credentials = Headers(scope=scope).get("authorization", "").partition(" ")
        # RFC 9110 (section 11.1): the scheme is case-insensitive, and one or more spaces follow it.
        given = credentials.lstrip(" ").encode()
        if scheme.lower() != "bearer":
            return False
        matches = [tenant for key, tenant in self._keys if secrets.compare_digest(given, key)]  # every key compared
        if not matches:
            return False
        if matches[0] is not None:
            scope.setdefault("state", {})[KEY_TENANT] = matches[0]
        return True
