"""Latency on the real model while the engine is busy: short requests behind a long prompt, and a
high-priority request when every seat is taken.

Run: OMP_NUM_THREADS=2 python benchmarks/bench_long_prompt.py [--checkout DIR] [--case long|seats] [--cold] [KEY=VALUE ...]

`long`: an 8,000-token prompt (16 tokens out) is sent; from 1 s later until it ends, short
streaming chat requests ("Hi", 8 tokens) go one after another. Prints the long request's time
and the short requests' TTFT p50 and max. A few warm-up requests teach the step cost first, unless
`--cold`: then the long prompt is the fresh server's first request.
`seats`: with BLOCKSERVE_SCHEDULING_POLICY=priority, low-priority streams take every seat
(BLOCKSERVE_MAX_NUM_SEQS), then one high-priority request arrives: prints its TTFT.

The real scheduler, worker (default model) and api processes of `--checkout` (default: this
one), so that two checkouts run side by side on one machine; KEY=VALUE are extra settings.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--checkout", type=Path, default=Path(__file__).resolve().parent.parent)
parser.add_argument("--case", choices=("long", "seats"), default="long")
parser.add_argument("--long-tokens", type=int, default=8000)
parser.add_argument("--cold", action="store_true", help="no warm-up requests: the long prompt is the server's first")
parser.add_argument("settings", nargs="*", help="extra settings, KEY=VALUE")
args = parser.parse_args()
sys.path.insert(0, str(args.checkout.resolve()))  # that checkout's service and tests

import httpx  # noqa: E402

from tests.support.processes import loopback_env, start, stop_all, wait_ready  # noqa: E402

SEATS = 8


def first_token_s(url: str, model: str, body: dict) -> float:
    """Seconds from sending a streaming chat request to its first non-empty content."""
    started = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={"model": model, **body}, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content"' in line and '"content":""' not in line:
                return time.monotonic() - started
    raise RuntimeError("no token")


def long_case(url: str, model: str) -> dict:
    rng = random.Random(0)
    long_prompt = [rng.randrange(100, 40000) for _ in range(args.long_tokens)]
    result = {}

    def long_request() -> None:
        started = time.monotonic()
        body = {"model": model, "prompt": long_prompt, "max_tokens": 16, "ignore_eos": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=900)
        result["long_s"], result["long_status"] = time.monotonic() - started, response.status_code

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(1.0)
    ttfts = []
    short = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True}
    while thread.is_alive():
        ttfts.append(first_token_s(url, model, short))
    thread.join()
    return {
        "long_s": round(result["long_s"], 2),
        "long_status": result["long_status"],
        "short_requests": len(ttfts),
        "short_ttft_p50_s": round(statistics.median(ttfts), 2) if ttfts else None,
        "short_ttft_max_s": round(max(ttfts), 2) if ttfts else None,
    }


def seats_case(url: str, model: str) -> dict:
    low = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 400}
    low |= {"ignore_eos": True, "stream": True, "priority": 5}
    streams = [threading.Thread(target=first_token_s, args=(url, model, low)) for _ in range(SEATS)]
    for stream in streams:
        stream.start()
    time.sleep(8.0)  # every low stream is decoding
    high = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True, "priority": -1}
    ttft = first_token_s(url, model, high)
    return {"seats": SEATS, "high_priority_ttft_s": round(ttft, 2)}


def main() -> None:
    extra = dict(setting.split("=", 1) for setting in args.settings)
    if args.case == "seats":
        extra = {"BLOCKSERVE_SCHEDULING_POLICY": "priority", "BLOCKSERVE_MAX_NUM_SEQS": str(SEATS), **extra}
    env = loopback_env(PYTHONPATH=str(args.checkout.resolve()), **extra)
    logs = Path(tempfile.mkdtemp())
    roles = ("scheduler", "worker", "api")
    processes = [start(["-m", "service.launch.cli", role], env, logs / f"{role}.log") for role in roles]
    url = f"http://127.0.0.1:{env['BLOCKSERVE_PORT']}"
    try:
        wait_ready(url, timeout_s=600)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        for i in range(0 if args.cold else 3):  # a few steps of different sizes, for the step cost to be learned
            body = {"model": model, "prompt": "Warm up " * (10 + 40 * i), "max_tokens": 8}
            httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        result = long_case(url, model) if args.case == "long" else seats_case(url, model)
        print(
            json.dumps(
                {"checkout": str(args.checkout), "case": args.case, "cold": args.cold, "settings": extra, **result}
            )
        )
    finally:
        stop_all(processes)


if __name__ == "__main__":
    main()
