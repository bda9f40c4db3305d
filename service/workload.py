"""Seeded synthetic request traces: length distributions and arrival processes.

Shared by the simulator and `blockserve bench`, so both replay the same trace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

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


def make_trace(workload: Workload) -> list[TraceRequest]:
    rng = np.random.default_rng(workload.seed)
    count = workload.num_requests
    input_lengths = workload.input_lengths.sample(rng, count)
    output_lengths = workload.output_lengths.sample(rng, count)
    if math.isinf(workload.request_rate):
        arrivals = np.zeros(count)
    else:
        shape = workload.burstiness
        gaps = rng.gamma(shape, 1.0 / (workload.request_rate * shape), size=count)
        arrivals = np.cumsum(gaps) - gaps[0]
    high = rng.random(count) < workload.high_priority_share
    # Token 0 is avoided: tokenizers often reserve it.
    return [
        TraceRequest(
            request_id=f"req-{index}",
            arrival_time_s=float(arrivals[index]),
            prompt_token_ids=rng.integers(1, workload.vocab_size, size=int(input_lengths[index])).tolist(),
            max_tokens=int(output_lengths[index]),
            priority=-1 if high[index] else 0,
        )
        for index in range(count)
    ]


NAMED_WORKLOADS = {
    "long-output": (LengthDistribution("uniform", 128), LengthDistribution("uniform", 512)),
    "long-input": (LengthDistribution("uniform", 1024), LengthDistribution("uniform", 64)),
    "chat": (LengthDistribution("chat", 256, max_len=4096), LengthDistribution("chat", 192, max_len=2048)),
    "fixed": (LengthDistribution("fixed", 128), LengthDistribution("fixed", 128)),
}
