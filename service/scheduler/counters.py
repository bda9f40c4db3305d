"""Counters the scheduler keeps about itself (read by metrics and the simulator)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from service.scheduler.request import Request

OTHER_TENANTS = "other"
DEFAULT_TENANT_LABELS = 10


@dataclass(slots=True)
class TenantTotals:
    """What one tenant label (a tenant, or `other`) was given since the scheduler started."""

    prompt_tokens: int = 0  # of its admitted requests
    generation_tokens: int = 0  # of its finished requests
    preemptions: int = 0


class TenantLabels:
    """Metric labels for tenants, bounded: the first `limit` tenants served get their own, the rest share
    `other`. A label never moves to another tenant, so every series only grows. Names are kept only for
    the labelled ones: a `user` per end user costs no memory."""

    def __init__(self, limit: int = DEFAULT_TENANT_LABELS):
        self.limit = limit
        self._named: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self._named:
            return tenant
        if len(self._named) < self.limit:
            self._named.add(tenant)
            return tenant
        return OTHER_TENANTS


@dataclass(slots=True)
class SchedulerCounters:
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    num_prompt_tokens: int = 0  # counted at first admission
    num_generation_tokens: int = 0  # counted as each token is accepted
    prefix_cache_queries: int = 0  # prompt tokens looked up at first admission
    prefix_cache_hits: int = 0  # of those, tokens served from the cache
    num_wasted_decode_slots: int = 0  # tokens computed for requests that had ended while their step ran
    num_step_cost_errors: int = 0  # the step cost model failed to learn or to size a chunk (scheduling went on)
    finished_by_reason: Counter = field(default_factory=Counter)
    tenant_label: TenantLabels = field(default_factory=TenantLabels)
    by_tenant: dict[str, TenantTotals] = field(default_factory=dict)  # by tenant label

    def of_tenant(self, tenant: str) -> TenantTotals:
        label = self.tenant_label(tenant)
        totals = self.by_tenant.get(label)
        if totals is None:
            totals = self.by_tenant[label] = TenantTotals()
        return totals

    def record_finish(self, request: Request) -> None:
        self.finished_by_reason[request.finish_reason.value] += 1
