"""The scheduler's Prometheus metrics. Names are chosen once; keep them.

Gauges and counters are read from the live scheduler at scrape time (no bookkeeping on the
step loop); latency histograms are observed by the loop as tokens go out.
"""

from __future__ import annotations

from typing import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from service.contract.wire import DEFAULT_TENANT, StepResult
from service.scheduler.batch_histogram import BatchHistogram
from service.scheduler.counters import SchedulerCounters, TenantTotals
from service.scheduler.outcome import StepOutcome
from service.scheduler.request import Request
from service.scheduler.scheduler import Scheduler
from service.scheduler.step_cost import TERMS as STEP_COST_TERMS

prometheus_client.disable_created_metrics()

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
STEP_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BATCH_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREEMPTION_BUCKETS = (0, 1, 2, 3, 5, 8, 13, 21)
FINISH_REASONS = ("stop", "length", "abort", "error")
STEP_LOOP_PARTS = ("schedule", "update", "fanout", "encode", "decode")
# server.py's DroppedFrame reasons
DROP_REASONS = ("malformed", "unexpected", "invalid", "unknown_worker", "slot_taken", "other_model", "handler_error")
PRIORITY_CLASSES = ("high", "default", "low")  # priority below 0, 0, above 0
TENANT = ["model_name", "tenant"]


def priority_class(request: Request) -> str:
    """The request's priority as a label with a small fixed set of values."""
    return "high" if request.priority < 0 else "low" if request.priority > 0 else "default"


class _LiveCollector(Collector):
    """Reads block-table and queue state, and the scheduler's counters, at scrape time."""

    def __init__(
        self,
        get_scheduler: Callable[[], Scheduler | None],
        counters: SchedulerCounters,
        get_model_name: Callable[[], str],
        settings_info: dict[str, str],
    ):
        self.get_scheduler = get_scheduler
        self.counters = counters
        self.get_model_name = get_model_name
        self.settings_info = settings_info

    def collect(self):
        model = self.get_model_name()
        scheduler = self.get_scheduler()
        kv = scheduler.kv if scheduler else None

        def gauge(name: str, doc: str, value: float):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], value)
            return family

        def counter(name: str, doc: str, value: float):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], value)
            return family

        yield from self._pool_gauges(model, scheduler)
        yield gauge(
            "blockserve_kv_blocks_cached",
            "Free KV-cache blocks that still hold a reusable cached prefix.",
            kv.pool.num_cached_free if kv else 0,
        )
        yield gauge(
            "blockserve_num_requests_running",
            "Requests holding blocks and being computed.",
            len(scheduler.running) if scheduler else 0,
        )
        yield gauge(
            "blockserve_num_requests_waiting",
            "Requests queued, preempted ones included.",
            len(scheduler.waiting) if scheduler else 0,
        )
        yield gauge(
            "blockserve_num_requests_preempted",
            "Queued requests that were preempted and wait to be recomputed.",
            scheduler.num_preempted_waiting if scheduler else 0,
        )
        counters = self.counters
        yield counter(
            "blockserve_num_preemptions",
            "Preemptions: a running request gave its blocks back.",
            counters.num_preemptions,
        )
        yield counter(
            "blockserve_recomputed_tokens",
            "Tokens computed again because their request had been preempted.",
            counters.num_recomputed_tokens,
        )
        yield counter("blockserve_prompt_tokens", "Prompt tokens of admitted requests.", counters.num_prompt_tokens)
        yield counter(
            "blockserve_generation_tokens", "Tokens generated and sent to clients.", counters.num_generation_tokens
        )
        yield counter(
            "blockserve_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            counters.prefix_cache_queries,
        )
        yield counter(
            "blockserve_prefix_cache_hits", "Prompt tokens served from the prefix cache.", counters.prefix_cache_hits
        )
        yield gauge(
            "blockserve_step_prefill_budget_tokens",
            "Prompt tokens the latest step could compute: the token budget, or fewer to keep the inter-token "
            "latency target (BLOCKSERVE_TARGET_ITL_MS) with the learned step cost.",
            scheduler.prefill_budget if scheduler else 0,
        )
        cost = GaugeMetricFamily(
            "blockserve_step_cost_seconds",
            "The learned cost of a step: seconds per step (fixed), per request, per token, per thousand cached "
            "tokens read.",
            labels=["model_name", "term"],
        )
        coefficients = scheduler.step_cost.fitted() if scheduler else dict.fromkeys(STEP_COST_TERMS, 0.0)
        for term, seconds in coefficients.items():
            cost.add_metric([model, term], seconds)
        yield cost
        yield counter(
            "blockserve_wasted_decode_slots",
            "Tokens computed for requests that had ended (stop token, abort) while their step was in flight.",
            counters.num_wasted_decode_slots,
        )
        yield counter(
            "blockserve_step_cost_errors",
            "Failures of the step cost model (learning, or sizing a prompt chunk); scheduling went on without it.",
            counters.num_step_cost_errors,
        )
        yield from self._tenant_families(model, scheduler)
        finished = CounterMetricFamily(
            "blockserve_requests_finished", "Finished requests by reason.", labels=["model_name", "reason"]
        )
        for reason in FINISH_REASONS:
            finished.add_metric([model, reason], counters.finished_by_reason[reason])
        yield finished
        info = InfoMetricFamily("blockserve_settings", "Effective settings of this scheduler (secrets redacted).")
        info.add_metric([], self.settings_info)
        yield info

    def _tenant_families(self, model: str, scheduler: Scheduler | None):
        """Per tenant label (the first BLOCKSERVE_TENANT_METRICS_LIMIT tenants, then `other`): tokens given and
        preemptions; and how far apart the active tenants' counters are."""
        families = {
            "prompt_tokens": CounterMetricFamily(
                "blockserve_tenant_prompt_tokens", "Prompt tokens of admitted requests, by tenant.", labels=TENANT
            ),
            "generation_tokens": CounterMetricFamily(
                "blockserve_tenant_generation_tokens",
                "Tokens generated for finished requests, by tenant.",
                labels=TENANT,
            ),
            "preemptions": CounterMetricFamily(
                "blockserve_tenant_preemptions", "Preemptions of requests, by tenant.", labels=TENANT
            ),
        }
        by_tenant = list(self.counters.by_tenant.items()) or [
            (DEFAULT_TENANT, TenantTotals())
        ]  # a series from the start
        for label, totals in by_tenant:
            for field, family in families.items():
                family.add_metric([model, label], getattr(totals, field))
        yield from families.values()
        fair_share = scheduler.fair_share if scheduler else None
        spread = GaugeMetricFamily(
            "blockserve_tenant_served_spread",
            "The largest difference between two active tenants' counters: weighted tokens served over weight "
            "(BLOCKSERVE_SCHEDULING_POLICY=fair keeps it bounded).",
            labels=["model_name"],
        )
        spread.add_metric([model], fair_share.spread() if fair_share else 0.0)
        yield spread
        active = GaugeMetricFamily(
            "blockserve_tenants_active", "Tenants with requests queued or running.", labels=["model_name"]
        )
        active.add_metric([model], len(fair_share.active()) if fair_share else 0)
        yield active

    @staticmethod
    def _pool_gauges(model: str, scheduler: Scheduler | None):
        """Usage, capacity and free blocks per table: `unified`, or `prefill` and `decode` in split-table mode."""
        pools = scheduler.kv.pool_usage() if scheduler else [("unified", 0, 0)]
        families = [
            GaugeMetricFamily(
                "blockserve_kv_cache_usage_ratio",
                "Share of KV blocks held by live requests (0-1).",
                labels=["model_name", "pool"],
            ),
            GaugeMetricFamily(
                "blockserve_kv_blocks_capacity", "KV-cache blocks in the table.", labels=["model_name", "pool"]
            ),
            GaugeMetricFamily(
                "blockserve_kv_blocks_free",
                "KV-cache blocks not held by any request (cached ones included).",
                labels=["model_name", "pool"],
            ),
        ]
        for name, capacity, used in pools:
            families[0].add_metric([model, name], used / capacity if capacity else 0.0)
            families[1].add_metric([model, name], capacity)
            families[2].add_metric([model, name], capacity - used)
        yield from families


class SchedulerMetrics:
    """Everything `/metrics` on the scheduler's metrics port shows."""

    def __init__(
        self,
        get_scheduler: Callable[[], Scheduler | None],
        counters: SchedulerCounters,
        get_model_name: Callable[[], str],
        settings_info: dict[str, object],
    ):
        self.registry = CollectorRegistry()
        self.get_model_name = get_model_name
        labels = {key.lower(): str(value) for key, value in settings_info.items()}
        self._live = _LiveCollector(get_scheduler, counters, get_model_name, labels)
        self.registry.register(self._live)

        self._model_histograms: list[tuple[Histogram, bool]] = []  # (family, labelled by priority class)

        def histogram(name: str, doc: str, buckets, by_priority: bool = False) -> Histogram:
            labels = ["model_name", "priority_class"] if by_priority else ["model_name"]
            family = Histogram(name, doc, labels, buckets=buckets, registry=self.registry)
            self._model_histograms.append((family, by_priority))
            return family

        self.ttft = histogram(
            "blockserve_time_to_first_token_seconds",
            "Time from arrival at the scheduler to the first token, by priority class (high < 0 < low).",
            LATENCY_BUCKETS_S,
            by_priority=True,
        )
        self.itl = BatchHistogram(
            "blockserve_inter_token_latency_seconds",
            "Time between consecutive tokens of a request.",
            LATENCY_BUCKETS_S,
            get_model_name,
        )
        self.registry.register(self.itl)
        self.e2e = histogram(
            "blockserve_e2e_request_latency_seconds", "Time from arrival to the last token.", LATENCY_BUCKETS_S
        )
        self.queue = histogram(
            "blockserve_request_queue_time_seconds",
            "Time from arrival to first being scheduled, by priority class.",
            LATENCY_BUCKETS_S,
            by_priority=True,
        )
        self.preemptions = histogram(
            "blockserve_request_preemptions",
            "Preemptions each finished request went through, by priority class.",
            PREEMPTION_BUCKETS,
            by_priority=True,
        )
        self.tenant_label = counters.tenant_label
        self.tenant_ttft = Histogram(
            "blockserve_tenant_time_to_first_token_seconds",
            "Time from arrival at the scheduler to the first token, by tenant (the first "
            "BLOCKSERVE_TENANT_METRICS_LIMIT tenants, then `other`).",
            TENANT,
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.tenant_queue = Histogram(
            "blockserve_tenant_request_queue_time_seconds",
            "Time from arrival to first being scheduled, by tenant.",
            TENANT,
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.step = histogram(
            "blockserve_step_duration_seconds", "Time from sending a step to the worker to its result.", STEP_BUCKETS_S
        )
        self.schedule = histogram(
            "blockserve_schedule_duration_seconds", "Time the scheduler takes to decide one step.", STEP_BUCKETS_S
        )
        self.batch_tokens = histogram("blockserve_batch_tokens", "Tokens computed in one step.", BATCH_TOKEN_BUCKETS)
        self.grammar_mask = histogram(
            "blockserve_grammar_mask_seconds",
            "Worker time per step with grammar-constrained rows spent on their masks: filling, applying, checking "
            "a greedy row's token after its draw and drawing again where refused, advancing the matchers (its share of a step: against blockserve_worker_compute_seconds).",
            STEP_BUCKETS_S,
        )
        self.worker_compute = histogram(
            "blockserve_worker_compute_seconds",
            "Worker time per step with grammar-constrained rows, all of it (the denominator of the mask's share).",
            STEP_BUCKETS_S,
        )
        self.constrained_rows = histogram(
            "blockserve_grammar_constrained_rows",
            "Grammar-constrained rows per step that has any.",
            BATCH_TOKEN_BUCKETS,
        )
        self.auth_failures = Counter(
            "blockserve_auth_failures",
            "CURVE handshakes refused (unknown client key), by socket: api or worker.",
            ["socket"],
            registry=self.registry,
        )
        for socket in ("api", "worker"):
            self.auth_failures.labels(socket)  # shown as 0 before the first refusal
        self.dropped_frames = Counter(
            "blockserve_dropped_frames",
            "Frames dropped by the scheduler, by socket (api, worker) and reason: malformed (not a message of "
            "this protocol), unexpected (a message that socket does not take), invalid (a nonsense hello), "
            "unknown_worker (from a worker that is not registered), slot_taken (a worker's hello while another "
            "is alive), other_model (a worker's hello for another model than the one served), handler_error "
            "(handling it raised).",
            ["socket", "reason"],
            registry=self.registry,
        )
        for socket in ("api", "worker"):
            for reason in DROP_REASONS:
                self.dropped_frames.labels(socket, reason)  # shown as 0 before the first drop
        step_loop = Counter(
            "blockserve_step_loop_seconds",
            "Scheduler time per part of the step loop: schedule, update (results into the core), fanout (deltas "
            "to the api replicas), encode (steps to the worker, sent), decode (every frame in).",
            ["part"],
            registry=self.registry,
        )
        self.step_loop_seconds = {part: step_loop.labels(part) for part in STEP_LOOP_PARTS}
        step_loop_errors = Counter(
            "blockserve_step_loop_errors",
            "Unexpected errors inside the step loop, by part: schedule (deciding a step) or update (taking a "
            "result), each of which ended the requests of that moment with an error; metrics (observing "
            "latencies), which lost those observations. The scheduler served on.",
            ["part"],
            registry=self.registry,
        )
        self.step_loop_errors = {part: step_loop_errors.labels(part) for part in ("schedule", "update", "metrics")}

    def add_settings_info(self, info: dict[str, str]) -> None:
        """More labels of blockserve_settings_info, e.g. what the registered worker computes with."""
        self._live.settings_info.update({key.lower(): str(value) for key, value in info.items()})

    def start_series(self, model: str) -> None:
        """Show every histogram of `model` at 0 from the start, so dashboards never see "No data"."""
        for family, by_priority in self._model_histograms:
            for labels in [(model, name) for name in PRIORITY_CLASSES] if by_priority else [(model,)]:
                family.labels(*labels)
        for family in (self.tenant_ttft, self.tenant_queue):
            family.labels(model, DEFAULT_TENANT)

    def serve(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def on_outcome(self, outcome: StepOutcome) -> None:
        """Latencies of what one scheduler call produced, from the requests' own timings."""
        if outcome.token_gaps_s:
            self.itl.observe_many(self.get_model_name(), outcome.token_gaps_s)
        if outcome.first_tokens:
            self.on_first_tokens(outcome.first_tokens)
        if outcome.finished:
            self.on_finished(outcome.finished)

    def on_first_tokens(self, requests: list[Request]) -> None:
        model = self.get_model_name()
        for request in requests:
            ttft_s = request.first_token_time - request.arrival_time
            self.ttft.labels(model, priority_class(request)).observe(ttft_s)
            self.tenant_ttft.labels(model, self.tenant_label(request.tenant.name)).observe(ttft_s)

    def on_finished(self, requests: list[Request]) -> None:
        model = self.get_model_name()
        e2e = self.e2e.labels(model)
        for request in requests:
            e2e.observe(request.finish_time - request.arrival_time)
            label = priority_class(request)
            if request.first_scheduled_time is not None:
                queued_s = request.first_scheduled_time - request.arrival_time
                self.queue.labels(model, label).observe(queued_s)
                self.tenant_queue.labels(model, self.tenant_label(request.tenant.name)).observe(queued_s)
            self.preemptions.labels(model, label).observe(request.num_preemptions)

    def on_schedule(self, num_tokens: int, schedule_s: float) -> None:
        model = self.get_model_name()
        self.batch_tokens.labels(model).observe(num_tokens)
        self.schedule.labels(model).observe(schedule_s)

    def on_step(self, step_s: float) -> None:
        self.step.labels(self.get_model_name()).observe(step_s)

    def on_grammar_masks(self, result: StepResult) -> None:
        """A worker's step result with constrained rows: the masks' time, the step's, and how many rows."""
        model = self.get_model_name()
        self.grammar_mask.labels(model).observe(result.grammar_mask_s)
        self.worker_compute.labels(model).observe(result.compute_s)
        self.constrained_rows.labels(model).observe(result.num_constrained)
