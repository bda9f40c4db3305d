"""Tenants on the real model: a quiet tenant beside a flooding one, and two backlogged tenants of weights 1 and 2.

Run: OMP_NUM_THREADS=2 python benchmarks/bench_tenants.py [--case quiet|weights] [--policy fair] [KEY=VALUE ...]

`quiet`: with 8 seats, a flooding tenant keeps four times the seats queued while a quiet tenant sends
one request at a time (short chat, 8 tokens); prints the quiet tenant's TTFT p50 beside the flood and
alone (the same server, before the flood), and their ratio.
`weights`: tenants `light` (weight 1) and `heavy` (weight 2) each send the same requests, all at once,
so both stay backlogged; prints the output tokens each received while both had requests queued (until
the first of them had none left), their ratio, and the output tokens per second of the whole run.

The real scheduler, worker (default model) and api processes of this checkout, on loopback ports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import httpx  # noqa: E402

from service.tools.bench.client import run_trace  # noqa: E402
from service.tools.workload import LengthDistribution, TenantMix, Workload, make_trace  # noqa: E402
from tests.support.processes import loopback_env, start, stop_all, wait_ready  # noqa: E402

SEATS = 8
QUIET_BODY = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True, "user": "quiet"}


def first_token_s(url: str, model: str, body: dict) -> float:
    started = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={"model": model, **body}, timeout=900) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content"' in line and '"content":""' not in line:
                return time.monotonic() - started
    raise RuntimeError("no token")


def quiet_case(url: str, model: str, num_quiet: int) -> dict:
    alone = [first_token_s(url, model, QUIET_BODY) for _ in range(num_quiet)]
    stop = threading.Event()
    flood_body = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 64, "ignore_eos": True}

    def flood() -> None:  # one of 4 x SEATS flooding clients, each sending again as soon as answered
        while not stop.is_set():
            httpx.post(f"{url}/v1/completions", json={**flood_body, "user": "flood"}, timeout=900)

    flooders = [threading.Thread(target=flood) for _ in range(4 * SEATS)]
    for thread in flooders:
        thread.start()
    time.sleep(10.0)  # every seat taken, the rest queued
    beside = [first_token_s(url, model, QUIET_BODY) for _ in range(num_quiet)]
    stop.set()
    for thread in flooders:
        thread.join()
    return {
        "quiet_ttft_p50_alone_s": round(statistics.median(alone), 3),
        "quiet_ttft_p50_beside_flood_s": round(statistics.median(beside), 3),
        "ratio": round(statistics.median(beside) / statistics.median(alone), 2),
    }


def weights_case(url: str, model: str, num_requests: int) -> dict:
    mix = (TenantMix("light", 0.5), TenantMix("heavy", 0.5))
    fixed = LengthDistribution("fixed", 64)
    trace = make_trace(Workload(num_requests, fixed, fixed, float("inf"), tenants=mix))
    timings, started, finished = asyncio.run(run_trace(url, model, trace, True, None, 1800))
    # Both backlogged until the first tenant's last request got its first token (nothing of it queued after).
    until = min(max(t.token_times_s[0] for t in timings if t.tenant == name) for name in ("light", "heavy"))
    tokens = {
        name: sum(1 for t in timings if t.tenant == name for at in t.token_times_s if at <= until)
        for name in ("light", "heavy")
    }
    total = sum(t.completion_tokens for t in timings)
    return {
        "window_s": round(until - started, 1),
        "tokens_while_both_backlogged": tokens,
        "heavy_over_light": round(tokens["heavy"] / tokens["light"], 3),
        "output_tokens_per_s": round(total / (finished - started), 1),
        "failed": sum(1 for t in timings if not t.ok),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=("quiet", "weights"), default="quiet")
    parser.add_argument("--policy", default="fair")
    parser.add_argument("--num-quiet", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("settings", nargs="*", help="extra settings, KEY=VALUE")
    args = parser.parse_args()
    extra = {
        "BLOCKSERVE_SCHEDULING_POLICY": args.policy,
        "BLOCKSERVE_MAX_NUM_SEQS": str(SEATS),
        "BLOCKSERVE_TENANT_WEIGHTS": json.dumps({"heavy": 2}),
        **dict(setting.split("=", 1) for setting in args.settings),
    }
    env = loopback_env(**extra)
    logs = Path(tempfile.mkdtemp())
    processes = [
        start(["-m", "service.launch.cli", role], env, logs / f"{role}.log") for role in ("scheduler", "worker", "api")
    ]
    url = f"http://127.0.0.1:{env['BLOCKSERVE_PORT']}"
    try:
        wait_ready(url, timeout_s=600)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        first_token_s(url, model, QUIET_BODY)  # warm-up
        result = (
            quiet_case(url, model, args.num_quiet)
            if args.case == "quiet"
            else weights_case(url, model, args.num_requests)
        )
        print(json.dumps({"case": args.case, "settings": extra, **result}))
    finally:
        stop_all(processes)


if __name__ == "__main__":
    main()
