"""Worker throughput on SmolLM2 beside the time its matrix multiplications alone take in Paddle.

Run: python benchmarks/bench_worker.py [--steps N]

Decode: B requests with a 128-token context each, one token per request per step.
Prefill: fresh prompts computed in one step (the step samples each request's first token).
"matmul only" runs the same model's matmuls with the same shapes (paddle.matmul only, the same
weight tensors): the ceiling this framework reaches on this machine. The breakdown times the
parts of the step with wall-clock timers (Paddle on CPU runs ops synchronously).
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from contextlib import contextmanager

os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))

import numpy as np  # noqa: E402
import paddle  # noqa: E402

import gpu_worker.model_runner as model_runner_module  # noqa: E402
import gpu_worker.models.llama as llama_module  # noqa: E402
from gpu_worker.model_runner import ModelRunner  # noqa: E402
from service import wire  # noqa: E402
from service.config import load_settings  # noqa: E402

CONTEXT_LEN = 128
DECODE_BATCHES = (1, 8, 32, 64)
PREFILLS = ((1, 512), (4, 256))
GREEDY = wire.SamplingParams(temperature=0.0, max_tokens=1 << 20)


class Timers:
    """Accumulated wall time per part of the step."""

    def __init__(self):
        self.seconds = defaultdict(float)

    @contextmanager
    def part(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - started

    def wrap(self, name: str, function):
        def timed(*args, **kwargs):
            with self.part(name):
                return function(*args, **kwargs)

        return timed


class TimedFunctional:
    """paddle.nn.functional with `linear` timed, for the model module's `F`."""

    def __init__(self, timers: Timers):
        self.linear = timers.wrap("linear matmuls", paddle.nn.functional.linear)

    def __getattr__(self, name):
        return getattr(paddle.nn.functional, name)


def instrument(runner: ModelRunner, timers: Timers) -> None:
    llama_module.F = TimedFunctional(timers)
    runner.attention.write_kv = timers.wrap("attention", runner.attention.write_kv)
    runner.attention.attend = timers.wrap("attention", runner.attention.attend)
    runner.attention.prepare = timers.wrap("input building", runner.attention.prepare)
    model_runner_module.build_step_inputs = timers.wrap("input building", model_runner_module.build_step_inputs)
    runner.model.compute_logits = timers.wrap("lm_head", runner.model.compute_logits)
    runner.sampler.sample = timers.wrap("sampling", runner.sampler.sample)


class Workload:
    """Hands out request ids and blocks, and builds the steps of one benchmark case."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.step_id = 0
        self.num_requests = 0
        self.rng = np.random.default_rng(0)

    def step(self, **fields) -> wire.StepResult:
        self.step_id += 1
        result = self.runner.execute(wire.SchedulerOutput(step_id=self.step_id, **fields))
        assert result.error is None, result.error
        return result

    def new_requests(self, count: int, prompt_len: int, room: int) -> list[wire.NewRequest]:
        blocks_each = -(-(prompt_len + room) // self.runner.block_size)
        self.num_requests += count
        return [
            wire.NewRequest(
                request_id=f"r{self.num_requests}-{i}",
                token_ids=self.rng.integers(100, 40000, prompt_len).tolist(),
                num_prompt_tokens=prompt_len,
                sampling=GREEDY,
                block_ids=list(range(i * blocks_each, (i + 1) * blocks_each)),
                num_computed_tokens=0,
                num_scheduled_tokens=prompt_len,
            )
            for i in range(count)
        ]


def median_step(run_step, steps: int, timers: Timers) -> tuple[float, dict[str, float]]:
    """(seconds, seconds per part) of the step with the median time; the machine is shared and noisy."""
    records = []
    for _ in range(steps):
        timers.seconds.clear()
        started = time.perf_counter()
        run_step()
        records.append((time.perf_counter() - started, dict(timers.seconds)))
    return sorted(records, key=lambda record: record[0])[len(records) // 2]


def time_decode(workload: Workload, batch: int, steps: int, timers: Timers):
    requests = workload.new_requests(batch, CONTEXT_LEN, room=steps + 2)
    for first in range(0, batch, 8):  # prefill a few at a time, untimed
        workload.step(new_requests=requests[first : first + 8])
    decode = [wire.RunningRequest(r.request_id, [], 1) for r in requests]
    workload.step(running_requests=decode)
    record = median_step(lambda: workload.step(running_requests=decode), steps, timers)
    workload.step(finished_request_ids=[r.request_id for r in requests])
    return record


def time_prefill(workload: Workload, count: int, prompt_len: int, steps: int, timers: Timers):
    batches = [workload.new_requests(count, prompt_len, room=1) for _ in range(steps + 1)]
    warm_up = batches.pop()
    workload.step(new_requests=warm_up)
    workload.step(finished_request_ids=[r.request_id for r in warm_up])

    def prefill_and_finish():
        requests = batches.pop()
        workload.step(new_requests=requests)
        with timers.part("untimed"):
            workload.step(finished_request_ids=[r.request_id for r in requests])

    seconds, parts = median_step(prefill_and_finish, steps, timers)
    return seconds - parts.pop("untimed"), parts


def matmul_only(runner: ModelRunner, num_tokens: int, num_samples: int, repeats: int) -> float:
    """Median seconds of one step's matmuls alone: every layer's projections, then the lm_head rows."""
    model = runner.model
    inputs = {}  # one random input per input width
    for layer in model.layers:
        for linear in layer.projections.values():
            width = linear.weight.shape[0]
            inputs.setdefault(width, paddle.randn([num_tokens, width]))
    last = paddle.randn([num_samples, model.config.hidden_size])

    def run():
        for layer in model.layers:
            for linear in layer.projections.values():
                paddle.matmul(inputs[linear.weight.shape[0]], linear.weight)
        paddle.matmul(last, model.lm_head, transpose_y=True)

    run()
    return median_seconds(run, repeats)


def median_seconds(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=9, help="timed steps per decode case (the median is shown)")
    args = parser.parse_args()
    runner = ModelRunner(load_settings(num_kv_blocks=1024))
    timers = Timers()
    instrument(runner, timers)
    workload = Workload(runner)
    prefill_steps = max(3, args.steps // 3)
    cases = []
    for batch in DECODE_BATCHES:
        cases.append((f"decode B={batch}", batch, batch, *time_decode(workload, batch, args.steps, timers)))
    for count, prompt_len in PREFILLS:
        record = time_prefill(workload, count, prompt_len, prefill_steps, timers)
        cases.append((f"prefill {count}x{prompt_len}", count * prompt_len, count, *record))
    print_tables(runner, cases, args.steps)


def print_tables(runner: ModelRunner, cases: list, steps: int) -> None:
    print(f"\nSmolLM2-135M fp32, Paddle {paddle.__version__} CPU, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    titles = ("tokens/step", "step ms", "tokens/s", "matmul ms", "ceiling tok/s", "ratio")
    print(f"{'case':<17}" + "".join(f"{title:>{width}}" for title, width in zip(titles, (12, 10, 10, 11, 15, 7))))
    for name, num_tokens, num_samples, step_s, _ in cases:
        matmul_s = matmul_only(runner, num_tokens, num_samples, steps)
        print(
            f"{name:<17}{num_tokens:>12}{step_s * 1e3:>10.1f}{num_tokens / step_s:>10.0f}{matmul_s * 1e3:>11.1f}"
            f"{num_tokens / matmul_s:>15.0f}{matmul_s / step_s:>7.2f}"
        )
    parts = ["linear matmuls", "lm_head", "attention", "input building", "sampling"]
    print("\nWhere the median step's time goes (ms; rest = norms, rope, activations, residual adds, python)")
    print(f"{'case':<17}" + "".join(f"{p:>16}" for p in parts) + f"{'rest':>9}")
    for name, _, _, step_s, seconds in cases:
        per_step = {part: seconds.get(part, 0.0) for part in parts}
        rest = step_s - sum(per_step.values())
        print(f"{name:<17}" + "".join(f"{per_step[p] * 1e3:>16.1f}" for p in parts) + f"{rest * 1e3:>9.1f}")


if __name__ == "__main__":
    main()
