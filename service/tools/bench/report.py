"""Summaries users expect from a serving benchmark (the `vllm bench serve` conventions).

TTFT: request start to first token. TPOT: (latency - TTFT) / (output tokens - 1) per request.
ITL: gaps between consecutive streamed chunks. Goodput: requests per second that met every SLO.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from service.tools.bench.client import RequestTiming


@dataclass(frozen=True, slots=True)
class Distribution:
    mean: float
    p50: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> "Distribution":
        if not values:
            return cls(0.0, 0.0, 0.0)
        array = np.asarray(values)
        return cls(float(array.mean()), float(np.percentile(array, 50)), float(np.percentile(array, 99)))


@dataclass(frozen=True, slots=True)
class BenchReport:
    num_requests: int
    num_completed: int
    num_failed: int
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_output_tokens: int
    ttft_s: Distribution
    tpot_s: Distribution
    itl_s: Distribution
    e2e_s: Distribution
    goodput_requests_per_s: float
    slo: dict[str, float]
    errors: list[str]
    by_tenant: dict[str, dict[str, float]]  # tenant -> completed requests, output tok/s, TTFT p50 (s)

    def as_dict(self) -> dict:
        return asdict(self)


def ttft(timing: RequestTiming) -> float:
    return timing.token_times_s[0] - timing.start_s


def tpot(timing: RequestTiming) -> float | None:
    if timing.completion_tokens < 2:
        return None
    return (timing.end_s - timing.start_s - ttft(timing)) / (timing.completion_tokens - 1)


def summarize(timings: list[RequestTiming], duration_s: float, slo: dict[str, float]) -> BenchReport:
    """`slo` maps 'ttft' / 'tpot' / 'e2e' to limits in seconds."""
    done = [t for t in timings if t.ok and t.token_times_s]
    ttfts = [ttft(t) for t in done]
    tpots = [v for t in done if (v := tpot(t)) is not None]
    itls = [b - a for t in done for a, b in zip(t.token_times_s, t.token_times_s[1:])]
    e2es = [t.end_s - t.start_s for t in done]

    def meets_slo(timing: RequestTiming) -> bool:
        measured = {"ttft": ttft(timing), "tpot": tpot(timing) or 0.0, "e2e": timing.end_s - timing.start_s}
        return all(measured[name] <= limit for name, limit in slo.items())

    output_tokens = sum(t.completion_tokens for t in done)
    failures = [t for t in timings if not t.ok or not t.token_times_s]
    return BenchReport(
        num_requests=len(timings),
        num_completed=len(done),
        num_failed=len(failures),
        duration_s=duration_s,
        requests_per_s=len(done) / duration_s,
        output_tokens_per_s=output_tokens / duration_s,
        total_output_tokens=output_tokens,
        ttft_s=Distribution.of(ttfts),
        tpot_s=Distribution.of(tpots),
        itl_s=Distribution.of(itls),
        e2e_s=Distribution.of(e2es),
        goodput_requests_per_s=sum(1 for t in done if meets_slo(t)) / duration_s,
        slo=slo,
        errors=sorted({t.error or "no tokens" for t in failures})[:20],
        by_tenant={
            tenant: {
                "num_completed": len(mine := [t for t in done if t.tenant == tenant]),
                "output_tokens_per_s": sum(t.completion_tokens for t in mine) / duration_s,
                "ttft_p50_s": Distribution.of([ttft(t) for t in mine]).p50,
            }
            for tenant in sorted({t.tenant for t in timings})
        },
    )


def format_report(report: BenchReport) -> str:
    lines = [
        f"requests: {report.num_completed}/{report.num_requests} completed, {report.num_failed} failed, {report.duration_s:.1f} s",
        f"throughput: {report.requests_per_s:.2f} req/s, {report.output_tokens_per_s:.1f} output tok/s",
        f"goodput: {report.goodput_requests_per_s:.2f} req/s within {report.slo or 'no SLO'}",
    ]
    for name, dist in (("TTFT", report.ttft_s), ("TPOT", report.tpot_s), ("ITL", report.itl_s), ("E2E", report.e2e_s)):
        lines.append(
            f"{name:>5} ms: mean {1000 * dist.mean:8.1f}  p50 {1000 * dist.p50:8.1f}  p99 {1000 * dist.p99:8.1f}"
        )
    if len(report.by_tenant) > 1:
        lines += [
            f"tenant {tenant}: {row['num_completed']} completed, {row['output_tokens_per_s']:.1f} output tok/s, "
            f"TTFT p50 {1000 * row['ttft_p50_s']:.1f} ms"
            for tenant, row in report.by_tenant.items()
        ]
    lines += [f"error: {error}" for error in report.errors]
    return "\n".join(lines)
