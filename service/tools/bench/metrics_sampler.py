"""Sample the scheduler's /metrics during a benchmark: KV usage and preemptions over time."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

SAMPLED = {
    "blockserve_kv_cache_usage_ratio": "kv_usage",
    "blockserve_num_preemptions_total": "preemptions",
    "blockserve_num_requests_running": "running",
    "blockserve_num_requests_waiting": "waiting",
    "blockserve_recomputed_tokens_total": "recomputed_tokens",
    "blockserve_generation_tokens_total": "generation_tokens",
    "blockserve_grammar_mask_seconds_sum": "grammar_mask_s",  # worker time on grammar masks, in steps that had any
    "blockserve_worker_compute_seconds_sum": "constrained_step_s",  # those steps' whole worker time
}


@dataclass
class MetricsTimeline:
    times_s: list[float] = field(default_factory=list)
    series: dict[str, list[float]] = field(default_factory=lambda: {name: [] for name in SAMPLED.values()})

    def delta(self, name: str) -> float:
        """Increase of a counter over the run."""
        values = self.series[name]
        return values[-1] - values[0] if values else 0.0


def parse(text: str) -> dict[str, float]:
    """Sampled metrics by short name; usage is the mean over pools, the rest are summed."""
    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in SAMPLED:
                values.setdefault(SAMPLED[sample.name], []).append(sample.value)
    return {name: (sum(v) / len(v) if name == "kv_usage" else sum(v)) for name, v in values.items()}


async def sample_until(
    url: str,
    stop: asyncio.Event,
    first_sample: asyncio.Event,
    timeline: MetricsTimeline,
    interval_s: float,
    started: float,
) -> None:
    """Sample every `interval_s` until `stop`, once more after it; `first_sample` is set after the first try."""
    async with httpx.AsyncClient(timeout=5) as http:
        while True:
            try:
                values = parse((await http.get(url)).text)
            except httpx.HTTPError:
                values = None
            if values and all(name in values for name in timeline.series):
                timeline.times_s.append(time.perf_counter() - started)
                for name in timeline.series:
                    timeline.series[name].append(values[name])
            first_sample.set()
            if stop.is_set():
                return
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except asyncio.TimeoutError:
                pass
