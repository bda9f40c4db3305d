"""How busy the step loop keeps a fast accelerator: the real scheduler, a fixed-step worker, an api peer.

Run: python benchmarks/bench_step_loop.py [--mode serial|async|both] [--quick] [--json PATH] [--plot PATH]

Each case starts the real `blockserve scheduler` process on loopback sockets and a model-free
worker process whose step takes a fixed time: the FakeWorker's deterministic tokens (the fake
model) and then a sleep for the rest (the CPU is free meanwhile, as under a blocking device sync).
Taking the step's deltas into the per-request state is the worker's input building; the worker
loop does it for the next step while this one's "device" time runs, where that step has come. This
process plays an api replica: it submits every request as token ids on the api socket at once
and drains their deltas. The worker's busy fraction is its sleeping time over the span from the
first step's start to the last step's end; the gap is the time between one step's end and the
next step's start. Where the gap goes: the scheduler's per-part seconds from its metrics (parts
it does not expose are left out), the worker's input building, and the worker's frame decoding
and result encoding (timed during the sleep, so the timing itself costs no gap).
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's service and tests, whatever else is installed
from service.contract import wire  # noqa: E402
from service.tools.fake_worker import FakeWorker  # noqa: E402
from tests.support.api_peer import ApiPeer  # noqa: E402
from tests.support.processes import loopback_env, stop  # noqa: E402

PROMPT_LEN = 8
BLOCK_SIZE = 16
VOCAB_SIZE = 50_000
FULL_CASES = [
    *((step_ms, running, 0) for step_ms in (1, 5, 20) for running in (64, 256, 1024)),
    (5, 256, 10_000),
]
QUICK_CASES = [(5, 64, 0), (5, 16, 100)]
STEP_LOOP_PARTS = "blockserve_step_loop_seconds_total"  # {part=...}, where the scheduler exposes it
SCHEDULE_HISTOGRAM = "blockserve_schedule_duration_seconds"


def max_tokens_for(step_ms: int, waiting: int, quick: bool) -> int:
    """Enough steps for a steady figure, few enough for the whole run to stay within minutes."""
    if quick:
        return 12
    if waiting:
        return 8
    return 60 if step_ms >= 20 else 150


# ---------------------------------------------------------------- the worker process


class FixedStepRunner:
    """A FakeWorker whose every step takes `step_s` of "device" time (its tokens included), with its timings kept."""

    def __init__(self, num_kv_blocks: int, step_s: float):
        self.model_info = wire.ModelInfo(
            name="fixed-step",
            max_model_len=1 << 16,
            vocab_size=VOCAB_SIZE,
            eos_token_ids=[0],
            bos_token_id=None,
            tokenizer_json="",
            chat_template=None,
        )
        self.num_kv_blocks = num_kv_blocks
        self.block_size = BLOCK_SIZE
        self.kernels: dict[str, str] = {}
        self.step_s = step_s
        self.worker = FakeWorker(num_kv_blocks, BLOCK_SIZE, VOCAB_SIZE)
        self.steps: list[dict[str, float]] = []

    # The worker loop's parts (worker.process.PipelinedRunner): the next step's input
    # building runs while the device "computes" this one, as on a GPU whose kernels run queued.

    def prepare(self, step: wire.SchedulerOutput) -> tuple[wire.SchedulerOutput, list, float, float]:
        started = time.perf_counter()
        work = self.worker.apply(step)  # the worker's input building
        return step, work, started, time.perf_counter()

    def launch(self, prepared: tuple) -> dict:
        step, work, prepare_started, prepare_ended = prepared
        device_started = time.perf_counter()
        result = self.worker.compute(step.step_id, work)  # the fake model: part of the step's fixed time
        frame = wire.encode(step)  # timed while the device "computes": the CPU is free then
        codec_started = time.perf_counter()
        wire.decode(frame)
        wire.encode(result)
        timings = {
            "started": prepare_started,
            "input_building_s": prepare_ended - prepare_started,
            "device_started": device_started,
            "codec_s": time.perf_counter() - codec_started,
        }
        return {"result": result, "device_ends": device_started + self.step_s, "timings": timings}

    def remaining_s(self, launched: dict) -> float:
        return max(0.0, launched["device_ends"] - time.perf_counter())

    def finish(self, launched: dict) -> wire.StepResult:
        time.sleep(self.remaining_s(launched))
        self.steps.append({**launched["timings"], "ended": time.perf_counter()})
        return launched["result"]

    def execute(self, step: wire.SchedulerOutput) -> wire.StepResult:
        return self.finish(self.launch(self.prepare(step)))


def run_worker(args: argparse.Namespace) -> None:
    from service.contract.config import load_settings
    from worker.process import serve_worker

    settings = load_settings()
    runner = FixedStepRunner(settings.num_kv_blocks, args.step_ms / 1000)
    serve_worker(runner, settings)
    Path(args.timings).write_text(json.dumps(runner.steps))


# ---------------------------------------------------------------- the api side


# ---------------------------------------------------------------- one case


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else 0.0


def scheduler_parts_s(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Seconds per step-loop part over the case, from the scheduler's metrics."""
    prefix = f"{STEP_LOOP_PARTS}|"
    parts = {key.removeprefix(prefix): after[key] - before.get(key, 0.0) for key in after if key.startswith(prefix)}
    if not parts and f"{SCHEDULE_HISTOGRAM}_sum" in after:
        parts["schedule"] = after[f"{SCHEDULE_HISTOGRAM}_sum"] - before.get(f"{SCHEDULE_HISTOGRAM}_sum", 0.0)
    return parts


def scrape_parts(port: str) -> dict[str, float]:
    """Metric samples with the part label folded into the name, e.g. `..._seconds_total|schedule`."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text):
        for sample in family.samples:
            key = f"{sample.name}|{sample.labels['part']}" if "part" in sample.labels else sample.name
            samples[key] = samples.get(key, 0.0) + sample.value
    return samples


def run_case(mode: str, step_ms: int, running: int, waiting: int, max_tokens: int, log_dir: Path) -> dict:
    num_requests = running + waiting
    blocks_each = -(-(PROMPT_LEN + max_tokens) // BLOCK_SIZE)
    env = loopback_env(
        BLOCKSERVE_ASYNC_SCHEDULING="1" if mode == "async" else "0",
        BLOCKSERVE_MAX_NUM_SEQS=str(running),
        BLOCKSERVE_MAX_NUM_BATCHED_TOKENS=str(max(2048, running * PROMPT_LEN)),
        BLOCKSERVE_NUM_KV_BLOCKS=str(2 * running * blocks_each + 64),
        BLOCKSERVE_BLOCK_SIZE=str(BLOCK_SIZE),
        BLOCKSERVE_LOG_LEVEL="WARNING",
    )
    name = f"{mode}-{step_ms}ms-{running}r-{waiting}w"
    timings_path = log_dir / f"{name}.steps.json"
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "service.launch.cli", "scheduler"],
            env=env,
            cwd=ROOT,
            stdout=open(log_dir / f"{name}.scheduler.log", "wb"),
            stderr=subprocess.STDOUT,
        ),
        subprocess.Popen(
            [sys.executable, __file__, "worker", "--step-ms", str(step_ms), "--timings", str(timings_path)],
            env=env,
            cwd=ROOT,
            stdout=open(log_dir / f"{name}.worker.log", "wb"),
            stderr=subprocess.STDOUT,
        ),
    ]
    peer = ApiPeer(env["BLOCKSERVE_SCHEDULER_ADDR"])
    try:
        peer.wait_until(lambda: peer.status(timeout_s=60).ready, timeout_s=60)
        before = scrape_parts(env["BLOCKSERVE_METRICS_PORT"])
        for index in range(num_requests):
            prompt = [(index * 7 + offset) % (VOCAB_SIZE - 1) + 1 for offset in range(PROMPT_LEN)]
            peer.submit(prompt, max_tokens, temperature=0.0)
        peer.wait_until(lambda: peer.all_finished, timeout_s=600)
        after = scrape_parts(env["BLOCKSERVE_METRICS_PORT"])
    finally:
        peer.close()
        for process in processes:  # the scheduler first: the worker serves until it has gone
            stop(process)
    if not timings_path.exists():
        raise RuntimeError(
            f"the worker left no timings; its log:\n{(log_dir / f'{name}.worker.log').read_text()[-3000:]}"
        )
    steps = json.loads(timings_path.read_text())
    return summarize(mode, step_ms, running, waiting, max_tokens, peer, steps, scheduler_parts_s(before, after))


def summarize(mode, step_ms, running, waiting, max_tokens, peer: ApiPeer, steps: list[dict], parts_s: dict) -> dict:
    device_s = sum(step["ended"] - step["device_started"] for step in steps)
    span_s = steps[-1]["ended"] - steps[0]["device_started"]
    gaps_s = [later["device_started"] - earlier["ended"] for earlier, later in zip(steps, steps[1:])]
    num_steps = len(steps)
    per_step_ms = {f"scheduler {part}": seconds * 1e3 / num_steps for part, seconds in sorted(parts_s.items())}
    # Mostly while the step before computes (prepared ahead), so only in part a gap.
    per_step_ms["worker input building"] = sum(s["input_building_s"] for s in steps) * 1e3 / num_steps
    per_step_ms["worker decode + encode"] = sum(s["codec_s"] for s in steps) * 1e3 / num_steps
    return {
        "mode": mode,
        "step_ms": step_ms,
        "running": running,
        "waiting": waiting,
        "max_tokens": max_tokens,
        "num_steps": num_steps,
        "busy_fraction": device_s / span_s,
        "gap_ms": {
            "p50": percentile(gaps_s, 0.5) * 1e3,
            "p99": percentile(gaps_s, 0.99) * 1e3,
            "mean": statistics.fmean(gaps_s) * 1e3 if gaps_s else 0.0,
        },
        "output_tokens": peer.num_tokens,
        "expected_tokens": (running + waiting) * max_tokens,
        "errors": sum(delta.finish_reason == "error" for delta in peer.finished.values()),
        "tokens_per_s": peer.num_tokens / max(peer.last_token_at - peer.first_token_at, 1e-9),
        "parts_ms_per_step": per_step_ms,
    }


# ---------------------------------------------------------------- report


def print_table(results: list[dict]) -> None:
    print(f"{'mode':<7}{'step':>6}{'running':>9}{'waiting':>9}{'busy':>7}{'gap p50':>9}{'gap p99':>9}{'tok/s':>9}")
    for r in results:
        gap = r["gap_ms"]
        print(
            f"{r['mode']:<7}{r['step_ms']:>4}ms{r['running']:>9}{r['waiting']:>9}{r['busy_fraction']:>7.3f}"
            f"{gap['p50']:>7.2f}ms{gap['p99']:>7.2f}ms{r['tokens_per_s']:>9.0f}"
        )
    print("\nWhere the gap goes (ms per step; overlapped parts in async mode need not add up to the gap)")
    for r in results:
        parts = ", ".join(f"{part} {ms:.2f}" for part, ms in r["parts_ms_per_step"].items())
        print(
            f"{r['mode']:<7}{r['step_ms']:>4}ms{r['running']:>6}r{r['waiting']:>6}w  gap {r['gap_ms']['mean']:.2f}: {parts}"
        )


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for mode in sorted({r["mode"] for r in results}):
        for color, step_ms in enumerate(sorted({r["step_ms"] for r in results})):
            points = sorted(
                (r["running"], r["busy_fraction"])
                for r in results
                if r["mode"] == mode and r["step_ms"] == step_ms and not r["waiting"]
            )
            if points:
                style = "-" if mode == "async" else "--"
                axes.plot(*zip(*points), style, color=f"C{color}", marker="o", label=f"{mode}, {step_ms} ms steps")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("running requests")
    axes.set_ylabel("worker busy fraction")
    axes.set_ylim(0, 1.05)
    axes.grid(alpha=0.3)
    axes.legend()
    axes.set_title("Step loop: fixed-step worker busy fraction")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    subcommands = parser.add_subparsers(dest="role")
    worker = subcommands.add_parser("worker", help="(internal) the fixed-step worker process")
    worker.add_argument("--step-ms", type=float, required=True)
    worker.add_argument("--timings", required=True)
    parser.add_argument("--mode", choices=["serial", "async", "both"], default="both")
    parser.add_argument("--quick", action="store_true", help="two small cases, for tests")
    parser.add_argument(
        "--case", action="append", metavar="STEP_MS:RUNNING:WAITING", help="run only these cases (repeatable)"
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="PNG of busy fraction against running requests")
    args = parser.parse_args()
    if args.role == "worker":
        run_worker(args)
        return
    modes = ["serial", "async"] if args.mode == "both" else [args.mode]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-step-loop-") as log_dir:
        chosen = [tuple(map(int, case.split(":"))) for case in args.case] if args.case else None
        for step_ms, running, waiting in chosen or (QUICK_CASES if args.quick else FULL_CASES):
            for mode in modes:
                max_tokens = max_tokens_for(step_ms, waiting, args.quick)
                results.append(run_case(mode, step_ms, running, waiting, max_tokens, Path(log_dir)))
                print_table(results[-1:])
    print()
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps({"cases": results}, indent=2))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
