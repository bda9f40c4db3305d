"""The api's own Prometheus metrics: HTTP traffic and the frames it had to drop.

Each app gets its own registry, so several apps (tests, or a process embedding one) never
collide. Route labels are route templates ("/v1/completions"), never raw paths, to keep the
label set small. Every route's series exist from the start, at 0, so dashboards and alerts see
a quiet route rather than a missing one.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.constraints import KINDS

UNMATCHED_ROUTE = "unmatched"
COMPILE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
DURATION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "blockserve_api_http_requests",
            "HTTP requests answered, by route, method and status code",
            ["route", "method", "status_code"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "blockserve_api_http_request_duration_seconds",
            "Time from request to the last byte of the response, by route",
            ["route"],
            buckets=DURATION_BUCKETS_S,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "blockserve_api_http_requests_in_flight",
            "HTTP requests being answered now",
            registry=self.registry,
        )
        self.engine_requests = Counter(
            "blockserve_api_engine_requests",
            "Requests this replica sent to each engine (its address)",
            ["engine"],
            registry=self.registry,
        )
        self.routing_decisions = Counter(
            "blockserve_api_routing_decisions",
            "Engines chosen, by what decided: prefix (a cached prefix), load, round_robin, or retry (another "
            "engine after one refused the request before starting it)",
            ["reason"],
            registry=self.registry,
        )
        for reason in ("prefix", "load", "round_robin", "retry"):
            self.routing_decisions.labels(reason)
        self.routed_prompt_blocks = Counter(
            "blockserve_api_routed_prompt_blocks",
            "Full KV-cache blocks of the prompts routed (the last token is always computed, so not counted)",
            registry=self.registry,
        )
        self.routed_matched_blocks = Counter(
            "blockserve_api_routed_matched_blocks",
            "Of those, the leading blocks the chosen engine's prefix cache held at routing time (or was computing "
            "for an open request of this replica)",
            registry=self.registry,
        )
        self.constrained_requests = Counter(
            "blockserve_api_constrained_requests",
            "Requests whose output a grammar constrains, by what gave it: json_schema, json_object, regex, choice, "
            "grammar",
            ["kind"],
            registry=self.registry,
        )
        self.grammar_compile = Histogram(
            "blockserve_api_grammar_compile_seconds",
            "Time to build and check a constraint's grammar (the compiled-grammar cache's misses), by kind",
            ["kind"],
            buckets=COMPILE_BUCKETS_S,
            registry=self.registry,
        )
        for kind in KINDS:
            self.constrained_requests.labels(kind)
            self.grammar_compile.labels(kind)
        self.malformed_frames = Counter(
            "blockserve_api_malformed_frames",
            "Frames from the scheduler dropped as malformed, unknown or of another protocol version",
            registry=self.registry,
        )

    def start_series(self, routes: dict[str, Iterable[str]]) -> None:
        """Create each route's duration histogram and its successful-requests counter at 0.

        `routes`: route template -> its methods, as the OpenAPI document's `paths` lists them.
        """
        for path, methods in routes.items():
            self.duration.labels(path)
            for method in methods:
                self.requests.labels(path, method.upper(), "200")

    def on_route(self, engine: str, reason: str, num_matched_blocks: int, num_prompt_blocks: int) -> None:
        self.engine_requests.labels(engine).inc()
        self.routing_decisions.labels(reason).inc()
        self.routed_matched_blocks.inc(num_matched_blocks)
        self.routed_prompt_blocks.inc(num_prompt_blocks)

    def on_engines_changed(self, added: list[str], dropped: list[str]) -> None:
        """An engine's request counter exists from when it is found (at 0) until it is gone."""
        for engine in added:
            self.engine_requests.labels(engine)
        for engine in dropped:
            self.engine_requests.remove(engine)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Counts and times every HTTP request, streamed responses to their end."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status_code = 500  # if the app fails before it starts a response
        started_s = time.perf_counter()

        async def send_and_note_status(message: Message) -> None:
            nonlocal status_code
            if message["type"] == "http.response.start":
                status_code = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            self.metrics.in_flight.dec()
            route = scope.get("route")
            route_path = getattr(route, "path_format", UNMATCHED_ROUTE)  # as the OpenAPI document names it
            self.metrics.requests.labels(route_path, scope["method"], str(status_code)).inc()
            self.metrics.duration.labels(route_path).observe(time.perf_counter() - started_s)
