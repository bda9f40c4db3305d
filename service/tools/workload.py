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
    num_shared_prefixes: int = 0  # each prompt starts with one of this many common prefixes (system prompts)
    shared_prefix_len: int = 0  # tokens of each of them


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
        )
        for index in range(count)
    ]


NAMED_WORKLOADS = {
    "long-output": (LengthDistribution("uniform", 128), LengthDistribution("uniform", 512)),
    "long-input": (LengthDistribution("uniform", 1024), LengthDistribution("uniform", 64)),
    "chat": (LengthDistribution("chat", 256, max_len=4096), LengthDistribution("chat", 192, max_len=2048)),
    "fixed": (LengthDistribution("fixed", 128), LengthDistribution("fixed", 128)),
}
