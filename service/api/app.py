"""The api app: OpenAI routes, probes and metrics, wired to one scheduler connection."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from service.api import chat, completions
from service.api.auth import ApiKeyMiddleware
from service.api.context import ApiContext, get_context
from service.api.errors import ApiError, install_error_handlers
from service.api.metrics import ApiMetrics, MetricsMiddleware
from service.api.protocol import ModelCard, ModelList
from service.api.scheduler_client import SchedulerClient
from service.config import Settings

READY_TIMEOUT_S = 1.0


def replica_id() -> str:
    return f"api-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def create_app(settings: Settings) -> FastAPI:
    """An api replica for `settings`; it connects to the scheduler when the server starts."""
    metrics = ApiMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = SchedulerClient(
            settings.scheduler_addr,
            replica_id(),
            idle_check_s=settings.worker_timeout_s,
            on_malformed_frame=metrics.malformed_frames.inc,
        )
        await client.start()
        app.state.context = ApiContext(client)
        try:
            yield
        finally:
            await client.close()

    app = FastAPI(title="blockserve", summary="OpenAI-compatible LLM inference", lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(completions.router)
    app.include_router(chat.router)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models(context: ApiContext = Depends(get_context)) -> ModelList:
        model = context.served_model()
        return ModelList(data=[ModelCard(id=model.name, max_model_len=model.max_model_len)])

    @app.get("/health")
    async def health() -> dict[str, str]:
        """The process is alive (says nothing about the scheduler or the model)."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(context: ApiContext = Depends(get_context)) -> JSONResponse:
        """200 only if the scheduler answers in time that it is ready to serve."""
        status = await context.client.status(READY_TIMEOUT_S) if context.client.connected else None
        if status is None:
            return JSONResponse({"ready": False, "reason": "the scheduler does not answer"}, status_code=503)
        if not status.ready:
            return JSONResponse({"ready": False, "reason": "the scheduler is not ready"}, status_code=503)
        try:
            context.served_model()
        except ApiError as exc:
            return JSONResponse({"ready": False, "reason": exc.message}, status_code=503)
        return JSONResponse({"ready": True, "num_workers": status.num_workers})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    if settings.api_key is not None and settings.api_key.get_secret_value():
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key.get_secret_value())
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outermost: counts the 401s too
    return app


def run_api(settings: Settings) -> None:
    """Serve the api on settings.host:settings.port until SIGINT/SIGTERM."""
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        timeout_graceful_shutdown=settings.drain_timeout_s,
    )
