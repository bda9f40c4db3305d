"""What the routes of one app share: the scheduler client and the model it serves."""

from __future__ import annotations

import logging

from fastapi import Request

from service.api.engines import EngineSet
from service.api.errors import ApiError
from service.api.grammar_cache import GrammarCache
from service.api.served_model import ServedModel
from service.api.tenants import TenantResolver
from service.contract.wire import ModelInfo

log = logging.getLogger(__name__)


class ApiContext:
    def __init__(
        self,
        client: EngineSet,
        tenant_of: TenantResolver,
        grammars: GrammarCache | None = None,
        tool_call_parser: str = "auto",
    ) -> None:
        self.client = client
        self.tool_call_parser = tool_call_parser
        self.tenant_of = tenant_of
        self.grammars = GrammarCache() if grammars is None else grammars
        self._built_from: ModelInfo | None = None
        self._model: ServedModel | None = None

    def served_model(self) -> ServedModel:
        """The model of this replica's engines; 503 while none of them is connected."""
        info = self.client.model
        if info is None:
            raise ApiError(503, "The model is not available: no scheduler has welcomed this api replica yet.")
        if not self.client.connected:
            raise ApiError(503, f"The model {info.name} is not available: no scheduler that serves it is connected.")
        if info is not self._built_from:
            self._built_from, self._model = info, None
            try:
                self._model = ServedModel(info, self.tool_call_parser)
            except Exception:
                log.exception("the tokenizer of model %s does not load", info.name)
        if self._model is None:
            raise ApiError(503, f"The tokenizer of model {info.name} could not be loaded.")
        return self._model


def get_context(request: Request) -> ApiContext:
    return request.app.state.context
