"""PNG plots of a benchmark: latency CDFs, and KV usage and preemptions over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from service.tools.bench.client import RequestTiming  # noqa: E402
from service.tools.bench.metrics_sampler import MetricsTimeline  # noqa: E402
from service.tools.bench.report import tpot, ttft  # noqa: E402


def latency_cdfs(timings: list[RequestTiming], path: Path) -> None:
    done = [t for t in timings if t.ok and t.token_times_s]
    series = {
        "TTFT": [ttft(t) for t in done],
        "TPOT": [v for t in done if (v := tpot(t)) is not None],
        "ITL": [b - a for t in done for a, b in zip(t.token_times_s, t.token_times_s[1:])],
        "E2E latency": [t.end_s - t.start_s for t in done],
    }
    figure, axes = plt.subplots(2, 2, figsize=(10, 7))
    for axis, (name, values) in zip(axes.flat, series.items()):
        if values:
            ordered = np.sort(np.asarray(values) * 1000)
            axis.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered))
        axis.set_title(f"{name} CDF")
        axis.set_xlabel("ms")
        axis.set_ylabel("fraction of samples")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def kv_timeline(timeline: MetricsTimeline, path: Path) -> None:
    figure, (usage_axis, preemption_axis) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    usage_axis.plot(timeline.times_s, timeline.series["kv_usage"])
    usage_axis.set_ylabel("KV-cache usage")
    usage_axis.set_ylim(0, 1.05)
    usage_axis.grid(alpha=0.3)
    preemption_axis.plot(timeline.times_s, timeline.series["preemptions"], label="preemptions (cumulative)")
    preemption_axis.plot(timeline.times_s, timeline.series["running"], label="running")
    preemption_axis.plot(timeline.times_s, timeline.series["waiting"], label="waiting")
    preemption_axis.set_xlabel("seconds since start")
    preemption_axis.legend()
    preemption_axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
