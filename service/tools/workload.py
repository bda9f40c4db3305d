"""Seeded synthetic request traces: length distributions and arrival processes.

Shared by the simulator and `blockserve bench`, so both replay the same trace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from service.contract.wire import DEFAULT_TENANT

LengthKind = Literal["fixed", "uniform", "chat"]


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """`fixed`: always `mean`; `uniform`: mean ± spread·mean; `chat`: long-tailed lognormal."""

    kind: LengthKind
    mean: int
    spread: float = 0.5
    max_len: int | None = None

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        if self.kind == "fixed":
            lengths = np.full(count, self.mean)
        elif self.kind == "uniform":
            low = max(1, round(self.mean * (1 - self.spread)))
            high = max(low, round(self.mean * (1 + self.spread)))
            lengths = rng.integers(low, high + 1, size=count)
        else:
            sigma = 1.0  # heavy tail: a few requests are ~10x the median
            lengths = rng.lognormal(math.log(self.mean) - sigma**2 / 2, sigma, size=count).round()
        lengths = np.maximum(lengths.astype(np.int64), 1)
        return np.minimum(lengths, self.max_len) if self.max_len else lengths


@dataclass(frozen=True, slots=True)
class TraceRequest:
    request_id: str
    arrival_time_s: float
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int = 0  # lower is served first (scheduling policy `priority`)
    tenant: str = DEFAULT_TENANT
    tenant_weight: float = 1.0  # what the simulator gives the tenant (a server takes weights from its settings)


@dataclass(frozen=True, slots=True)
class TenantMix:
    """One tenant of a trace: its share of the requests, its own arrival rate (None: the trace's rate
    times its share) and its weight."""

    name: str
    share: float
    rate: float | None = None
    weight: float = 1.0

    @classmethod
    def parse(cls, text: str) -> "TenantMix":
        """NAME:SHARE[:RATE[:WEIGHT]], e.g. `flood:0.8:20` or `quiet:0.2:1:2`."""
        name, share, *rest = text.split(":")
        if not name or len(rest) > 2:
            raise ValueError(f"a tenant is NAME:SHARE[:RATE[:WEIGHT]], not {text!r}")
        rate = float(rest[0]) if rest and rest[0] else None
        return cls(name, float(share), rate, float(rest[1]) if len(rest) > 1 else 1.0)


@dataclass(frozen=True, slots=True)
class Workload:
    num_requests: int
    input_lengths: LengthDistribution
    output_lengths: LengthDistribution
    request_rate: float = math.inf  # requests per second; inf = all at once
    burstiness: float = 1.0  # gamma shape of inter-arrival times; 1 = Poisson
    vocab_size: int = 32_000
    seed: int = 0
    high_priority_share: float = 0.0  # this share of the requests gets priority -1, the others 0
    num_shared_prefixes: int = 0  # each prompt starts with one of this many common prefixes (system prompts)
    shared_prefix_len: int = 0  # tokens of each of them
    tenants: tuple[TenantMix, ...] = ()  # none: every request is the default tenant's


def make_trace(workload: Workload) -> list[TraceRequest]:
    rng = np.random.default_rng(workload.seed)
    count = workload.num_requests
    input_lengths = workload.input_lengths.sample(rng, count)
    output_lengths = workload.output_lengths.sample(rng, count)
    arrivals = _arrivals(rng, count, workload.request_rate, workload.burstiness)
    tenant_of = _tenants(rng, workload, arrivals) if workload.tenants else np.zeros(count, int)
    tenants = workload.tenants or (TenantMix(DEFAULT_TENANT, 1.0),)
    # Drawn only when asked for, so the traces of other workloads stay what they were.
    high = rng.random(count) < workload.high_priority_share if workload.high_priority_share else np.zeros(count, bool)
    prefixes = [
        rng.integers(1, workload.vocab_size, size=workload.shared_prefix_len).tolist()
        for _ in range(workload.num_shared_prefixes)
    ]
    prefix_of = rng.integers(0, len(prefixes), size=count) if prefixes else np.zeros(count, int)
    # Token 0 is avoided: tokenizers often reserve it.
    return [
        TraceRequest(
            request_id=f"req-{index}",
            arrival_time_s=float(arrivals[index]),
            prompt_token_ids=(prefixes[prefix_of[index]] if prefixes else [])
            + rng.integers(1, workload.vocab_size, size=int(input_lengths[index])).tolist(),
            max_tokens=int(output_lengths[index]),
            priority=-1 if high[index] else 0,
            tenant=tenants[tenant_of[index]].name,
            tenant_weight=tenants[tenant_of[index]].weight,
        )
        for index in range(count)
    ]


def _arrivals(rng: np.random.Generator, count: int, rate: float, burstiness: float) -> np.ndarray:
    """Arrival times of `count` requests at `rate` per second (inf: all at once); gamma gaps of shape `burstiness`."""
    if math.isinf(rate):
        return np.zeros(count)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=count)
    return np.cumsum(gaps) - gaps[0]


def _tenants(rng: np.random.Generator, workload: Workload, arrivals: np.ndarray) -> np.ndarray:
    """Each request's tenant (an index into `workload.tenants`), by the tenants' shares. A tenant with a rate of
    its own gets arrivals at that rate: `arrivals` is rewritten in place, then sorted with the tenants."""
    count, mixes = len(arrivals), workload.tenants
    shares = np.array([mix.share for mix in mixes], float)
    tenant_of = rng.choice(len(mixes), size=count, p=shares / shares.sum())
    for index, mix in enumerate(mixes):
        if mix.rate is not None:
            mine = np.flatnonzero(tenant_of == index)
            arrivals[mine] = _arrivals(rng, len(mine), mix.rate, workload.burstiness)
    order = np.argsort(arrivals, kind="stable")
    arrivals[:] = arrivals[order]
    return tenant_of[order]


NAMED_WORKLOADS = {
    "long-output": (LengthDistribution("uniform", 128), LengthDistribution("uniform", 512)),
    "long-input": (LengthDistribution("uniform", 1024), LengthDistribution("uniform", 64)),
    "chat": (LengthDistribution("chat", 256, max_len=4096), LengthDistribution("chat", 192, max_len=2048)),
    "fixed": (LengthDistribution("fixed", 128), LengthDistribution("fixed", 128)),
}
