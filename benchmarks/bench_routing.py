"""Many engines behind one api: throughput over 1, 2 and 4 engines, and the routing modes on a
shared-prefix trace.

Run: python benchmarks/bench_routing.py [--quick] [--only scaling|routing] [--json PATH]

Each engine is the real scheduler process with a model-free worker whose step takes a fixed time
(FAKE_STEP_DELAY_S); one real api process routes over all of them; `blockserve bench` drives the
api. Scaling: the same per-engine load on 1, 2 and 4 engines; output tokens/s against N times
one engine's, TTFT p50/p99, each engine's share. Routing: 8 system prompts of 256 tokens x many
users in random order, 4 at a time, on 2 engines whose caches each hold about half of them, for each
routing mode: the engines' prefix-cache hit rate, their hits against an oracle's (every prompt finds
its system prompt cached, but the first of each), the prompt tokens they computed, TTFT.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's service and tests, whatever else is installed
from service.launch.cli import main as blockserve  # noqa: E402
from service.tools.bench.command import add_arguments, build_trace  # noqa: E402
from tests.support.processes import FakeStack, metric_samples, scrape  # noqa: E402
from tests.support.tiny_model import tiny_model_info  # noqa: E402

STEP_S = "0.05"
SEATS_PER_ENGINE = 16
BLOCK_SIZE = 16
SHARED_PREFIX_LEN = 256


def bench(stack: FakeStack, result_dir: Path, *args: str) -> dict:
    code = blockserve(
        ["bench", "--url", stack.url, "--vocab-size", str(VOCAB_SIZE), "--result-dir", str(result_dir), *args]
    )
    assert code == 0
    return json.loads((result_dir / "result.json").read_text())["report"]


def engine_counters(stack: FakeStack) -> list[dict[str, float]]:
    return [scrape(engine["BLOCKSERVE_METRICS_PORT"]) for engine in stack.engines]


def shares(stack: FakeStack) -> list[float]:
    per_engine = {
        s.labels["engine"]: s.value
        for s in metric_samples(stack.env["BLOCKSERVE_PORT"], "blockserve_api_engine_requests_total")
    }
    total = sum(per_engine.values()) or 1.0
    return [per_engine.get(engine["BLOCKSERVE_SCHEDULER_ADDR"], 0.0) / total for engine in stack.engines]


def scaling(num_engines: int, num_requests_per_engine: int, log_dir: Path) -> dict:
    env = dict(
        BLOCKSERVE_NUM_KV_BLOCKS="512",
        BLOCKSERVE_BLOCK_SIZE=str(BLOCK_SIZE),
        BLOCKSERVE_MAX_NUM_SEQS=str(SEATS_PER_ENGINE),
        BLOCKSERVE_LOG_LEVEL="WARNING",
        FAKE_STEP_DELAY_S=STEP_S,
    )
    with FakeStack(log_dir, num_engines=num_engines, **env) as stack:
        report = bench(
            stack,
            log_dir / "bench",
            "--workload", "custom", "--input-len", "32", "--output-len", "48", "--length-kind", "fixed",
            "--num-requests", str(num_requests_per_engine * num_engines),
            "--max-concurrency", str(SEATS_PER_ENGINE * num_engines),
        )  # fmt: skip
        return {
            "engines": num_engines,
            "output_tokens_per_s": report["output_tokens_per_s"],
            "ttft_p50_s": report["ttft_s"]["p50"],
            "ttft_p99_s": report["ttft_s"]["p99"],
            "failed": report["num_failed"],
            "shares": shares(stack),
        }


def shared_prefix_trace_args(num_requests: int) -> list[str]:
    return [
        "--workload", "custom", "--input-len", "24", "--output-len", "4", "--length-kind", "uniform",
        "--shared-prefixes", "8", "--shared-prefix-len", str(SHARED_PREFIX_LEN),
        "--num-requests", str(num_requests), "--max-concurrency", "4", "--seed", "3",
    ]  # fmt: skip


def oracle_hits(trace_args: Sequence[str]) -> int:
    """The prompt tokens an all-knowing router gets from the caches on this trace: every prompt's shared
    prefix (its full blocks), but for the first prompt of each prefix."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    trace = build_trace(parser.parse_args([*trace_args, "--vocab-size", str(VOCAB_SIZE)]))
    seen: set[tuple[int, ...]] = set()
    hits = 0
    for request in trace:
        prefix = tuple(request.prompt_token_ids[:SHARED_PREFIX_LEN])
        if prefix in seen:
            hits += min(SHARED_PREFIX_LEN, len(request.prompt_token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
        seen.add(prefix)
    return hits


def routing(mode: str, num_requests: int, log_dir: Path) -> dict:
    env = dict(
        BLOCKSERVE_NUM_KV_BLOCKS="96",  # 16-token blocks: about 5 of the 8 system prompts (16 blocks each)
        BLOCKSERVE_BLOCK_SIZE=str(BLOCK_SIZE),
        BLOCKSERVE_ROUTING=mode,
        BLOCKSERVE_LOG_LEVEL="WARNING",
        FAKE_STEP_DELAY_S="0.01",
        FAKE_TOKEN_DELAY_S="0.0002",  # prefill costs: computed prompt tokens show in TTFT
        FAKE_MAX_MODEL_LEN="1024",
    )
    trace_args = shared_prefix_trace_args(num_requests)
    with FakeStack(log_dir, num_engines=2, **env) as stack:
        report = bench(stack, log_dir / "bench", *trace_args)
        counters = engine_counters(stack)
        queries = sum(c["blockserve_prefix_cache_queries_total"] for c in counters)
        hits = sum(c["blockserve_prefix_cache_hits_total"] for c in counters)
        return {
            "routing": mode,
            "hit_rate": hits / queries if queries else 0.0,
            "of_oracle_hits": hits / oracle_hits(trace_args),
            "prompt_tokens_computed": int(queries - hits),
            "ttft_p50_s": report["ttft_s"]["p50"],
            "ttft_p99_s": report["ttft_s"]["p99"],
            "failed": report["num_failed"],
            "shares": shares(stack),
        }


VOCAB_SIZE = tiny_model_info().vocab_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, for tests")
    parser.add_argument("--only", choices=["scaling", "routing"], help="run one part (default: both)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    per_engine, prefix_requests = (16, 48) if args.quick else (64, 200)
    results = {"scaling": [], "routing": []}
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        for num_engines in (1, 2, 4) if args.only != "routing" else ():
            row = scaling(num_engines, per_engine, Path(tmp) / f"scaling-{num_engines}")
            results["scaling"].append(row)
            one = results["scaling"][0]["output_tokens_per_s"]
            print(
                f"{num_engines} engine(s): {row['output_tokens_per_s']:8.1f} output tok/s "
                f"({row['output_tokens_per_s'] / (one * num_engines):.2f} x {num_engines} x one engine's), "
                f"TTFT p50 {row['ttft_p50_s']:.3f} s p99 {row['ttft_p99_s']:.3f} s, failed {row['failed']}, "
                f"shares {' '.join(f'{share:.2f}' for share in row['shares'])}",
                flush=True,
            )
        for mode in ("prefix", "load", "round_robin") if args.only != "scaling" else ():
            row = routing(mode, prefix_requests, Path(tmp) / f"routing-{mode}")
            results["routing"].append(row)
            print(
                f"{mode:>11}: hit rate {row['hit_rate']:.2f} ({row['of_oracle_hits']:.3f} of an oracle's hits), prompt tokens computed {row['prompt_tokens_computed']}, "
                f"TTFT p50 {row['ttft_p50_s']:.3f} s p99 {row['ttft_p99_s']:.3f} s, failed {row['failed']}, "
                f"shares {' '.join(f'{share:.2f}' for share in row['shares'])}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
