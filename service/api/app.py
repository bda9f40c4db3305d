"""The api app: OpenAI routes, probes and metrics, wired to one scheduler connection."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from service.api import chat, completions
from service.api.auth import ApiKeyMiddleware
from service.api.body_limit import BodyLimitMiddleware
from service.api.context import ApiContext, get_context
from service.api.engines import EngineSet, NotReady
from service.api.errors import ApiError, install_error_handlers
from service.api.grammar_cache import GrammarCache
from service.api.metrics import ApiMetrics, MetricsMiddleware
from service.api.openapi import errors, install_openapi
from service.api.protocol import ChatCompletionChunk, CompletionResponse, Health, ModelCard, ModelList, Readiness
from service.api.tenants import TenantResolver
from service.contract import socket_auth
from service.contract.config import Settings

READY_TIMEOUT_S = 1.0


def replica_id() -> str:
    return f"api-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def create_app(settings: Settings) -> FastAPI:
    """An api replica for `settings`; it connects to the scheduler when the server starts."""
    metrics = ApiMetrics()
    client_keys = socket_auth.client_keys(settings)  # before serving: a bad key fails the start

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = EngineSet(
            settings.scheduler_addr,
            settings.engine_discovery,
            settings.routing,
            replica_id(),
            idle_check_s=settings.worker_timeout_s,
            on_malformed_frame=metrics.malformed_frames.inc,
            client_keys=client_keys,
            on_route=metrics.on_route,
            on_engines_changed=metrics.on_engines_changed,
        )
        await client.start()
        grammars = GrammarCache(
            on_compiled=lambda kind, seconds: metrics.grammar_compile.labels(kind).observe(seconds),
            on_request=lambda kind: metrics.constrained_requests.labels(kind).inc(),
        )
        app.state.context = ApiContext(client, TenantResolver(settings), grammars, settings.tool_call_parser)
        try:
            yield
        finally:
            grammars.close()
            await client.close()

    app = FastAPI(title="blockserve", summary="OpenAI-compatible LLM inference", lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(completions.router)
    app.include_router(chat.router)

    @app.get("/v1/models", response_model=ModelList, responses=errors(401, 503))
    async def list_models(context: ApiContext = Depends(get_context)) -> ModelList:
        model = context.served_model()
        return ModelList(data=[ModelCard(id=model.name, max_model_len=model.max_model_len)])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=errors(401, 404, 503))
    async def retrieve_model(model_id: str, context: ApiContext = Depends(get_context)) -> ModelCard:
        """The served model, by its name or an alias (the card names it as /v1/models does)."""
        model = context.served_model()
        model.check_name(model_id)
        return ModelCard(id=model.name, max_model_len=model.max_model_len)

    @app.get("/health", response_model=Health)
    async def health() -> Health:
        """The process is alive (says nothing about the scheduler or the model)."""
        return Health(status="ok")

    @app.get(
        "/ready",
        response_model=Readiness,
        responses={503: {"model": Readiness, "description": "Not ready, and why"}},
    )
    async def ready(context: ApiContext = Depends(get_context)) -> JSONResponse:
        """200 only if a scheduler of the replica's model answers in time that it is ready to serve; else
        503 saying what is missing."""
        try:
            status = await context.client.ready_status(READY_TIMEOUT_S)
            context.served_model()
        except NotReady as exc:
            return JSONResponse({"ready": False, "reason": str(exc)}, status_code=503)
        except ApiError as exc:
            return JSONResponse({"ready": False, "reason": exc.message}, status_code=503)
        return JSONResponse({"ready": True, "num_workers": status.num_workers})

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text"}},
    )
    async def prometheus_metrics() -> PlainTextResponse:
        """The api's own metrics in Prometheus' text format (the scheduler serves its own)."""
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    install_openapi(app, [CompletionResponse, ChatCompletionChunk], lambda: served_vocab_size(app))
    metrics.start_series(app.openapi()["paths"])
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=int(settings.max_request_body_bytes))
    if keys := api_keys(settings):
        app.add_middleware(ApiKeyMiddleware, keys=keys)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outermost: counts the 401s and 413s too
    return app


def api_keys(settings: Settings) -> dict[str, tuple[str, float] | None]:
    """The keys a request may carry: the one key (no tenant of its own) and the tenants' keys."""
    keys: dict[str, tuple[str, float] | None] = {}
    if settings.api_key is not None and settings.api_key.get_secret_value():
        keys[settings.api_key.get_secret_value()] = None
    keys.update(settings.tenant_keys())
    return keys


def served_vocab_size(app: FastAPI) -> int | None:
    """The vocabulary size of the model the scheduler named, or None before it has."""
    context = getattr(app.state, "context", None)  # None: before the lifespan started
    model = context.client.model if context is not None else None
    return model.vocab_size if model is not None else None


class DrainingServer(uvicorn.Server):
    """uvicorn that, told to stop, gives open requests `drain_timeout_s` and then ends them with an
    error (a stream: an error event and [DONE]) rather than cutting their connections."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout_s: float):
        super().__init__(config)
        self.app = app
        self.drain_timeout_s = drain_timeout_s

    async def shutdown(self, sockets=None) -> None:
        context = getattr(self.app.state, "context", None)  # None: stopped before the lifespan started
        if context is not None:
            reason = f"The server is shutting down: the request did not finish within {self.drain_timeout_s:g} s."
            asyncio.get_running_loop().call_later(self.drain_timeout_s, context.client.fail_open_requests, reason)
        await super().shutdown(sockets)


def run_api(settings: Settings) -> None:
    """Serve the api on settings.host:settings.port until SIGINT/SIGTERM."""
    app = create_app(settings)
    # uvicorn's own limit is a backstop past the drain: by then every request has ended.
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, timeout_graceful_shutdown=settings.drain_timeout_s + 5
    )
    DrainingServer(config, app, settings.drain_timeout_s).run()
