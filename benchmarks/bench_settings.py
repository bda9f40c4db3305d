"""Whole-service speed of several settings: one `blockserve serve` per setting and round, the same `blockserve bench`
trace against each, settings taking turns round by round so that all see the same machine.

    python benchmarks/bench_settings.py [--rounds 2] [--num-requests 64] [--concurrency 16] \
        --setting default= \
        --setting old-default=BLOCKSERVE_QUANTIZATION=none,BLOCKSERVE_DTYPE=bfloat16,BLOCKSERVE_CPU_ISA=avx512+bf16+vnni

A setting is NAME=ENV=VALUE,ENV=VALUE,... (nothing after the first '=': the defaults); CHECKOUT=DIR in it serves
that checkout's code instead of this one's (a git worktree of an older commit, say: its defaults as they were then),
the same `blockserve bench` client measuring both. Each server first answers a
short warm-up trace (its kernels' first calls, the dtype probe of `auto`), which is not counted. Quoted per round and
setting: output tok/s, TTFT p50 and TPOT p50; then each setting's output tok/s over all rounds as a ratio of the
first setting's, and its TTFT p50 likewise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.processes import loopback_env, start, stop, wait_ready  # noqa: E402


def parse_setting(text: str) -> tuple[str, dict[str, str]]:
    """ "name=A=1,B=2" -> ("name", {"A": "1", "B": "2"})."""
    name, _, assignments = text.partition("=")
    env = {}
    for assignment in filter(None, assignments.split(",")):
        key, sep, value = assignment.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"{assignment!r} is not ENV=VALUE")
        env[key] = value
    if not name:
        raise argparse.ArgumentTypeError(f"{text!r} names no setting")
    return name, env


def bench(url: str, out: Path, args: argparse.Namespace, num_requests: int, output_len: int, seed: int) -> dict:
    """One `blockserve bench` run; each run its own prompts (`seed`), so none finds another's in the prefix cache."""
    command = [
        sys.executable, "-m", "service.launch.cli", "bench", "--url", url,
        "--workload", "custom", "--input-len", str(args.input_len), "--output-len", str(output_len),
        "--num-requests", str(num_requests), "--max-concurrency", str(args.concurrency), "--result-dir", str(out),
        "--seed", str(seed),
    ]  # fmt: skip
    subprocess.run(command, check=True, cwd=ROOT, capture_output=True, text=True)
    report = json.loads((out / "result.json").read_text())["report"]
    assert report["num_failed"] == 0, report
    return report


def wait_for_kv_cache_pages(log: Path, env_extra: dict[str, str], timeout_s: float = 120) -> None:
    """Until the worker's log says its KV cache moved into 2 MiB pages (a thread it starts as it registers,
    worker/startup.py): the trace measures the server as it serves from then on, not its last second of start-up."""
    if env_extra.get("BLOCKSERVE_HUGE_PAGES", "1").lower() in ("0", "false"):
        return
    deadline = time.monotonic() + timeout_s
    while "of the KV cache's" not in log.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{log}: the KV cache's move into 2 MiB pages did not end in {timeout_s} s")
        time.sleep(0.2)


def run_setting(name: str, env_extra: dict[str, str], args: argparse.Namespace, work: Path, seed: int) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    env_extra = dict(env_extra)
    checkout = env_extra.pop("CHECKOUT", None)
    env = loopback_env(BLOCKSERVE_MAX_NUM_SEQS=str(args.concurrency), **env_extra)
    log = work / f"{name}-serve.log"
    serve = start(["-m", "service.launch.cli", "serve"], env, log, cwd=Path(checkout).resolve() if checkout else ROOT)
    url = f"http://127.0.0.1:{env['BLOCKSERVE_PORT']}"
    try:
        wait_ready(url, timeout_s=900)
        if not checkout:  # older checkouts moved their KV cache before they were ready, and log it otherwise
            wait_for_kv_cache_pages(log, env_extra)
        bench(url, work / f"{name}-warmup", args, 4, 8, seed=10_000 + seed)
        return bench(url, work / name, args, args.num_requests, args.output_len, seed=seed)
    finally:
        stop(serve, timeout_s=60)


def quantile_ms(report: dict, metric: str) -> float:
    return report[metric]["p50"] * 1000.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", type=parse_setting, action="append", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-settings-"))
    rates: dict[str, list[float]] = {name: [] for name, _ in args.setting}
    ttfts: dict[str, list[float]] = {name: [] for name, _ in args.setting}
    try:
        for round_index in range(args.rounds):
            order = args.setting if round_index % 2 == 0 else list(reversed(args.setting))
            for name, env_extra in order:
                report = run_setting(name, env_extra, args, work / f"r{round_index}", seed=round_index)
                rates[name].append(report["output_tokens_per_s"])
                ttfts[name].append(quantile_ms(report, "ttft_s"))
                print(
                    f"round {round_index} {name}: output tok/s {report['output_tokens_per_s']:.1f}, "
                    f"TTFT p50 {quantile_ms(report, 'ttft_s'):.0f} ms, TPOT p50 {quantile_ms(report, 'tpot_s'):.1f} ms",
                    flush=True,
                )
    finally:
        print(f"logs and results in {work}")
    first = args.setting[0][0]
    for name, _ in args.setting:
        print(
            f"{name}: output tok/s {sum(rates[name]) / sum(rates[first]):.2f}x {first}'s, "
            f"TTFT p50 (median of rounds) {statistics.median(ttfts[name]) / statistics.median(ttfts[first]):.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
