"""What the fair policy costs the scheduler per step, against fcfs, on a busy server.

Run: python benchmarks/bench_fair_policy.py [--waiting 256] [--tenants 4] [--rounds 300]

256 requests decode, one of them ends every step and the next waiting one takes its seat, with
`--waiting` requests queued behind them from `--tenants` tenants (round robin). Each policy's
schedule() + update() is timed step by step, the two policies taking turns in one process, and
the median per-step time of each and their ratio are printed.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from service.contract import wire  # noqa: E402
from service.scheduler.scheduler import SchedulerConfig, build_scheduler  # noqa: E402

NUM_RUNNING = 256
PROMPT_LEN = 64


class BusyServer:
    def __init__(self, policy: str, num_waiting: int, num_tenants: int):
        config = SchedulerConfig(
            num_blocks=64 * NUM_RUNNING,
            block_size=16,
            max_num_seqs=NUM_RUNNING,
            max_num_batched_tokens=PROMPT_LEN * NUM_RUNNING,
            scheduling_policy=policy,
        )
        self.scheduler = build_scheduler(config)
        self.num_waiting = num_waiting
        self.num_tenants = num_tenants
        self.arrivals = itertools.count()
        for index in range(NUM_RUNNING):  # the i-th ends at step i
            self.arrive(index + 1)
        self.step()

    def arrive(self, max_tokens: int) -> None:
        index = next(self.arrivals)
        sampling = wire.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        prompt = list(range(index, index + PROMPT_LEN))
        self.scheduler.add_request(f"r{index}", prompt, sampling, 0.0, tenant=f"tenant-{index % self.num_tenants}")

    def step(self) -> float:
        started = time.perf_counter()
        step = self.scheduler.schedule(0.0)
        sampled = [wire.SampledToken(request.request_id, 7) for request in step.requests]
        self.scheduler.update(step, wire.StepResult(step_id=step.step_id, sampled=sampled), 0.0)
        elapsed = time.perf_counter() - started
        while len(self.scheduler.waiting) < self.num_waiting:
            self.arrive(NUM_RUNNING)
        return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiting", type=int, default=256)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    servers = {policy: BusyServer(policy, args.waiting, args.tenants) for policy in ("fcfs", "fair")}
    times: dict[str, list[float]] = {policy: [] for policy in servers}
    for _ in range(args.rounds):
        for policy, server in servers.items():
            times[policy].append(server.step())
    medians = {policy: statistics.median(seconds) * 1e3 for policy, seconds in times.items()}
    print(f"{NUM_RUNNING} running, {args.waiting} waiting from {args.tenants} tenants, one admitted a step")
    for policy, median_ms in medians.items():
        print(f"  {policy:<5} {median_ms:.3f} ms per step (median of {args.rounds})")
    print(f"  fair / fcfs = {medians['fair'] / medians['fcfs']:.3f}")


if __name__ == "__main__":
    main()
