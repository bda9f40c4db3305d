"""Unified table vs the legacy split tables, on the real server and in the simulator.

Runs `blockserve bench` against scheduler + worker + api processes started once per
configuration (unified, and legacy at each KV_CACHE_RATIO) on a long-output and a long-input
workload with a KV cache small enough to matter; then the same comparison in the simulator at
10,000 requests. Writes docs/benchmarks.md (tables) and docs/benchmarks.png (plot).

    python scripts/compare_schedulers.py            # about 15 minutes on 2 CPU cores
    python scripts/compare_schedulers.py --quick    # smaller traces, a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.launch.cli import main as blockserve  # noqa: E402
from service.scheduler.scheduler import SchedulerConfig  # noqa: E402
from service.scheduler.split_table import SplitTableConfig  # noqa: E402
from service.tools.simulator import simulate  # noqa: E402
from service.tools.workload import LengthDistribution, Workload, make_trace  # noqa: E402
from tests.support.processes import loopback_env, start, stop, wait_ready  # noqa: E402

RATIOS = (0.3, 0.5, 0.75, 0.9)
MODES = [("unified", None)] + [(f"legacy {ratio}", ratio) for ratio in RATIOS]
# Real server on CPU: short enough to run, long enough that the cache fills.
SERVER_WORKLOADS = {
    "long-output": ("--input-len", "32", "--output-len", "128"),
    "long-input": ("--input-len", "320", "--output-len", "24"),
}
SERVER_KV_BLOCKS = 48  # of 16 tokens: 768 tokens, a few long-output requests at once
SIM_WORKLOADS = {
    "long-output": (LengthDistribution("uniform", 128), LengthDistribution("uniform", 768)),
    "long-input": (LengthDistribution("uniform", 1536), LengthDistribution("uniform", 96)),
}
SIM_KV_BLOCKS = 2048


def run_server(mode_ratio: float | None, workload: str, num_requests: int, logs: Path) -> dict:
    overrides = {"BLOCKSERVE_NUM_KV_BLOCKS": str(SERVER_KV_BLOCKS), "BLOCKSERVE_MAX_NUM_SEQS": "32"}
    if mode_ratio is not None:
        overrides.update(ENABLE_V1_KVCACHE_SCHEDULER="0", KV_CACHE_RATIO=str(mode_ratio))
    env = loopback_env(**overrides)
    processes = [
        start(["-m", "service.launch.cli", role], env, logs / f"{role}-{workload}-{mode_ratio}.log")
        for role in ("scheduler", "worker", "api")
    ]
    url = f"http://127.0.0.1:{env['BLOCKSERVE_PORT']}"
    result_dir = logs / f"{workload}-{mode_ratio}"
    try:
        wait_ready(url, timeout_s=300)
        blockserve(
            [
                "bench",
                "--url",
                url,
                "--metrics-url",
                f"http://127.0.0.1:{env['BLOCKSERVE_METRICS_PORT']}/metrics",
                "--workload",
                "custom",
                "--length-kind",
                "uniform",
                *SERVER_WORKLOADS[workload],
                "--num-requests",
                str(num_requests),
                "--vocab-size",
                "32000",
                "--result-dir",
                str(result_dir),
            ]
        )
    finally:
        for process in reversed(processes):
            stop(process)
    result = json.loads((result_dir / "result.json").read_text())
    report, server = result["report"], result["server"]
    return {
        "output_tokens_per_s": report["output_tokens_per_s"],
        "failed": report["num_failed"],
        "preemptions": server["preemptions"],
        "recomputed_tokens": server["recomputed_tokens"],
        "ttft_p99_s": report["ttft_s"]["p99"],
    }


def run_simulation(mode_ratio: float | None, workload: str, num_requests: int) -> dict:
    inputs, outputs = SIM_WORKLOADS[workload]
    trace = make_trace(Workload(num_requests, inputs, outputs, request_rate=40.0, seed=7))
    config = SchedulerConfig(
        num_blocks=SIM_KV_BLOCKS, block_size=16, max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=8192
    )
    split_table = None if mode_ratio is None else SplitTableConfig(kv_cache_ratio=mode_ratio)
    report = simulate(trace, config, split_table=split_table)
    return {
        "output_tokens_per_s": report.output_tokens_per_s,
        "failed": report.num_failed + report.num_rejected,
        "preemptions": report.num_preemptions,
        "recomputed_tokens": report.num_recomputed_tokens,
        "ttft_p99_s": report.ttft_p99_s,
    }


def table(title: str, results: dict[str, dict[str, dict]]) -> str:
    lines = [f"### {title}", ""]
    for workload, by_mode in results.items():
        base = by_mode["unified"]["output_tokens_per_s"]
        lines += [
            f"**{workload}**",
            "",
            "| scheduler | output tok/s | vs unified | failed or incomplete | preemptions | recomputed tokens | TTFT p99 (s) |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for mode, row in by_mode.items():
            relative = row["output_tokens_per_s"] / base if base else 0.0
            lines.append(
                f"| {mode} | {row['output_tokens_per_s']:.1f} | {relative:.2f}x | {row['failed']} | "
                f"{int(row['preemptions'])} | {int(row['recomputed_tokens'])} | {row['ttft_p99_s']:.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(server: dict, simulated: dict, path: Path) -> None:
    figure, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for axis, (title, results) in zip(axes, (("real server", server), ("simulator, 10,000 requests", simulated))):
        width = 0.8 / len(results)
        for offset, (workload, by_mode) in enumerate(results.items()):
            base = by_mode["unified"]["output_tokens_per_s"] or 1.0
            values = [row["output_tokens_per_s"] / base for row in by_mode.values()]
            positions = [i + offset * width for i in range(len(values))]
            axis.bar(positions, values, width, label=workload)
            for position, value, row in zip(positions, values, by_mode.values()):
                if row["failed"]:  # their throughput counts only the requests that completed
                    axis.annotate(f"{row['failed']} failed", (position, value), ha="center", va="bottom", fontsize=7)
        axis.set_xticks([i + width / 2 for i in range(len(MODES))], [mode for mode, _ in MODES], rotation=20)
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_title(title)
        axis.set_ylabel("output throughput relative to unified")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--from-json", type=Path, help="re-render the docs from a saved docs/benchmarks.json")
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        write_docs(saved["server"], saved["simulated"], saved["server_requests"], saved["sim_requests"])
        return 0
    server_requests, sim_requests = (8, 500) if args.quick else (24, 10_000)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    logs = Path(tempfile.mkdtemp(prefix="compare-"))
    server = {w: {mode: run_server(ratio, w, server_requests, logs) for mode, ratio in MODES} for w in SERVER_WORKLOADS}
    simulated = {w: {mode: run_simulation(ratio, w, sim_requests) for mode, ratio in MODES} for w in SIM_WORKLOADS}
    write_docs(server, simulated, server_requests, sim_requests)
    print(f"logs and per-run results in {logs}")
    return 0


def write_docs(server: dict, simulated: dict, server_requests: int, sim_requests: int) -> None:
    docs = ROOT / "docs"
    docs.mkdir(exist_ok=True)
    plot(server, simulated, docs / "benchmarks.png")
    saved = {"server": server, "simulated": simulated, "server_requests": server_requests, "sim_requests": sim_requests}
    (docs / "benchmarks.json").write_text(json.dumps(saved, indent=2))
    body = "\n".join(
        [
            table(
                f"Real server: SmolLM2 on CPU, {SERVER_KV_BLOCKS} KV blocks of 16 tokens, {server_requests} requests at once",
                server,
            ),
            table(f"Simulator: {sim_requests} requests, Poisson 40 req/s, {SIM_KV_BLOCKS} KV blocks", simulated),
        ]
    )
    (docs / "benchmarks.md").write_text(HEADER + body + "\n![relative throughput](benchmarks.png)\n")
    print(body)


HEADER = """# Unified block table vs legacy split tables

Generated by `python scripts/compare_schedulers.py` (do not edit by hand). Each row is one run
of `blockserve bench` (real server) or of the simulator on the same seeded trace. Legacy is the
split-table mode (`ENABLE_V1_KVCACHE_SCHEDULER=0`) at the given `KV_CACHE_RATIO`; failed
requests are those rejected (a prompt larger than the prefill table) or ended incomplete.

"""

if __name__ == "__main__":
    sys.exit(main())
