"""Structured outputs' cost on the whole service: `blockserve bench` with a JSON Schema on every request against the
same trace without one, alternated on one `blockserve serve`, so both see the same machine; then the masks' share
of a step at 64 constrained requests at once.

    python benchmarks/bench_structured_outputs.py [--rounds 2] [--num-requests 64] [--concurrency 16]

The schema (benchmarks/schemas/readings.json) asks for 24 readings, far more than --output-len tokens, so
constrained requests run to max_tokens as the unconstrained ones (ignore_eos) do. Output tok/s are quoted as the
ratio constrained / unconstrained, per round and in all.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.processes import loopback_env, start, stop, wait_ready  # noqa: E402

SCHEMA = ROOT / "benchmarks" / "schemas" / "readings.json"


def bench(
    url: str, metrics_url: str, out: Path, args: argparse.Namespace, concurrency: int, schema: bool, seed: int
) -> dict:
    """One `blockserve bench` run; each run its own prompts (`seed`), so none finds another's in the prefix cache."""
    command = [
        sys.executable, "-m", "service.launch.cli", "bench", "--url", url, "--metrics-url", metrics_url,
        "--workload", "custom", "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--num-requests", str(args.num_requests), "--max-concurrency", str(concurrency), "--result-dir", str(out), "--seed", str(seed),
    ]  # fmt: skip
    if schema:
        command += ["--json-schema", f"@{SCHEMA}"]
    subprocess.run(command, check=True, cwd=ROOT, capture_output=True, text=True)
    return json.loads((out / "result.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--share-concurrency", type=int, default=64, help="the masks' share is measured at this")
    parser.add_argument("--share-output-len", type=int, default=16, help="output tokens of the share's requests")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-so-"))
    env = loopback_env(BLOCKSERVE_MAX_NUM_SEQS=str(max(args.concurrency, args.share_concurrency)))
    serve = start(["-m", "service.launch.cli", "serve"], env, work / "serve.log")
    url, metrics_url = (
        f"http://127.0.0.1:{env['BLOCKSERVE_PORT']}",
        f"http://127.0.0.1:{env['BLOCKSERVE_METRICS_PORT']}/metrics",
    )
    try:
        wait_ready(url, timeout_s=600)
        warmup = argparse.Namespace(**{**vars(args), "num_requests": 4, "output_len": 8})
        bench(url, metrics_url, work / "warmup", warmup, 4, True, seed=1000)
        totals = {False: 0.0, True: 0.0}
        for round_index in range(args.rounds):
            rates = {}
            for schema in (False, True) if round_index % 2 == 0 else (True, False):
                out = work / f"r{round_index}-{schema}"
                result = bench(url, metrics_url, out, args, args.concurrency, schema, seed=2 * round_index + schema)
                report = result["report"]
                assert report["num_failed"] == 0, report
                rates[schema] = report["output_tokens_per_s"]
                totals[schema] += rates[schema]
            print(
                f"round {round_index}: output tok/s without a schema {rates[False]:.1f}, with {rates[True]:.1f}: "
                f"ratio {rates[True] / rates[False]:.3f}"
            )
        print(f"all rounds: ratio {totals[True] / totals[False]:.3f}")
        at_once = argparse.Namespace(
            **{**vars(args), "num_requests": args.share_concurrency, "output_len": args.share_output_len}
        )
        shared = bench(url, metrics_url, work / "share", at_once, args.share_concurrency, True, seed=1001)
        share = shared["server"].get("grammar_mask_share")
        print(
            f"{args.share_concurrency} constrained requests at once: masks {100 * share:.1f}% of the worker's step time"
        )
    finally:
        stop(serve, timeout_s=60)
        print(f"logs and results in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
