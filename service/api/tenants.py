"""Whose request it is: the tenant the `fair` scheduling policy shares the engine among.

From the API key (`BLOCKSERVE_API_KEYS` maps each key to its tenant and weight), else from
OpenAI's `user` field, else from a header a gateway sets (`BLOCKSERVE_TENANT_HEADER`), else the
default tenant. Weights not given with a key come from `BLOCKSERVE_TENANT_WEIGHTS` (1 where not
named). Tenant names may be customer names: they are never logged at info level.
"""

from __future__ import annotations

from starlette.requests import Request

from service.api.errors import ApiError
from service.contract.config import Settings
from service.contract.limits import MAX_TENANT_CHARS
from service.contract.wire import DEFAULT_TENANT

KEY_TENANT = "tenant_of_key"  # where the key check leaves the key's (tenant, weight) in the request's scope state


class TenantResolver:
    def __init__(self, settings: Settings):
        self.header = settings.tenant_header.lower()
        self.weights = settings.tenant_weights

    def __call__(self, request: Request, user: str | None) -> tuple[str, float]:
        """(tenant, weight) of an HTTP request whose body named `user` (or None)."""
        if (of_key := request.scope.get("state", {}).get(KEY_TENANT)) is not None:
            return of_key
        tenant = user or (request.headers.get(self.header) if self.header else None) or DEFAULT_TENANT
        if len(tenant) > MAX_TENANT_CHARS:  # only the header can be longer: `user` is bounded by the schema
            raise ApiError(400, f"The header {self.header} names a tenant longer than {MAX_TENANT_CHARS} characters.")
        return tenant, self.weights.get(tenant, 1.0)
