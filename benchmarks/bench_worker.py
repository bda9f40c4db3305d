"""Worker step time on SmolLM2, custom kernels against pure Paddle and against the "matmul floor".

Run: OMP_NUM_THREADS=2 python benchmarks/bench_worker.py [--steps N]

Decode: B requests with a 128-token context each, one token per request per step.
Prefill: fresh prompts computed in one step (the step samples each request's first token).
Both kernel paths (BLOCKSERVE_KERNELS=custom and =paddle) run every case in the same run.
"matmul floor" is the time torch's fp32 matmuls of the same shapes take (every layer's fused q|k|v,
o, gate|up and down, then the lm_head rows that sample), on weights of the model's sizes. For decode
B=1 the weight-read line gives the time to read every weight once at the read bandwidth measured in
this run (torch's sum over a 1 GiB array). The breakdown times the parts of the median step with
wall-clock timers (Paddle on CPU runs ops synchronously).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections import defaultdict
from contextlib import contextmanager

os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import torch  # noqa: E402

import gpu_worker.model_runner as model_runner_module  # noqa: E402
from gpu_worker.model_runner import ModelRunner  # noqa: E402
from gpu_worker.step_inputs import build_step_inputs  # noqa: E402
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


def instrument(runner: ModelRunner, timers: Timers) -> None:
    model = runner.model
    linears = ("qkv", "o", "gate_up", "down")
    model.layers = [
        dataclasses.replace(layer, **{name: timers.wrap("linear matmuls", getattr(layer, name)) for name in linears})
        for layer in model.layers
    ]
    runner.attention.attend_qkv = timers.wrap("attention", runner.attention.attend_qkv)  # rope, KV write, attention
    runner.attention.prepare = timers.wrap("input building", runner.attention.prepare)
    model_runner_module.build_step_inputs = timers.wrap("input building", build_step_inputs)
    model.compute_logits = timers.wrap("lm_head", model.compute_logits)
    runner.sampler.draw = timers.wrap("sampling", runner.sampler.draw)


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


class MatmulFloor:
    """torch fp32 matmuls with the shapes of one step's linear layers, on weights of the model's sizes."""

    def __init__(self, runner: ModelRunner):
        config = runner.model.config
        qkv_width = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        shapes = [
            (config.hidden_size, qkv_width),
            (config.num_heads * config.head_dim, config.hidden_size),
            (config.hidden_size, 2 * config.intermediate_size),
            (config.intermediate_size, config.hidden_size),
        ]
        # Each layer its own weights, so decode reads them all from memory as the model does.
        self.layers = [[torch.randn(shape) for shape in shapes] for _ in range(config.num_layers)]
        self.lm_head = torch.randn(config.hidden_size, config.vocab_size)

    @property
    def weight_bytes(self) -> int:
        weights = [w for layer in self.layers for w in layer] + [self.lm_head]
        return sum(w.numel() * w.element_size() for w in weights)

    def seconds(self, num_tokens: int, num_samples: int, repeats: int) -> float:
        inputs = {w.shape[0]: torch.randn(num_tokens, w.shape[0]) for w in self.layers[0]}
        last = torch.randn(num_samples, self.lm_head.shape[0])

        def run():
            for layer in self.layers:
                for weight in layer:
                    torch.matmul(inputs[weight.shape[0]], weight)
            torch.matmul(last, self.lm_head)

        run()
        return median_seconds(run, repeats)


def read_bandwidth(repeats: int = 5) -> float:
    """Bytes per second torch reads (sums) a 1 GiB array at: the best of a few runs."""
    array = torch.ones(2**28)
    array.sum()
    best = min(timed(array.sum) for _ in range(repeats))
    return array.numel() * array.element_size() / best


def timed(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def median_seconds(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def run_cases(kernels: str, steps: int) -> tuple[ModelRunner, list]:
    """(runner, [(case, tokens per step, samples per step, median step seconds, seconds per part)])."""
    runner = ModelRunner(load_settings(num_kv_blocks=1024, kernels=kernels))
    assert runner.kernels["kernels"] == kernels, runner.kernels
    timers = Timers()
    instrument(runner, timers)
    workload = Workload(runner)
    cases = []
    for batch in DECODE_BATCHES:
        cases.append((f"decode B={batch}", batch, batch, *time_decode(workload, batch, steps, timers)))
    for count, prompt_len in PREFILLS:
        record = time_prefill(workload, count, prompt_len, max(3, steps // 3), timers)
        cases.append((f"prefill {count}x{prompt_len}", count * prompt_len, count, *record))
    return runner, cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=9, help="timed steps per decode case (the median is shown)")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    custom_runner, custom = run_cases("custom", args.steps)
    kernels = custom_runner.kernels
    del custom_runner
    paddle_runner, paddle_cases = run_cases("paddle", args.steps)
    floor = MatmulFloor(paddle_runner)
    floors = [floor.seconds(num_tokens, num_samples, args.steps) for _, num_tokens, num_samples, _, _ in custom]
    print(
        f"\nSmolLM2-135M fp32, Paddle {paddle.__version__} / torch {torch.__version__} CPU, "
        f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, custom kernels: {kernels}"
    )
    titles = ("tokens/step", "step ms", "tokens/s", "paddle ms", "vs paddle", "floor ms", "vs floor")
    widths = (12, 10, 10, 11, 11, 10, 10)
    print(f"{'case':<17}" + "".join(f"{title:>{width}}" for title, width in zip(titles, widths)))
    for (name, num_tokens, _, step_s, _), (_, _, _, paddle_s, _), floor_s in zip(custom, paddle_cases, floors):
        print(
            f"{name:<17}{num_tokens:>12}{step_s * 1e3:>10.1f}{num_tokens / step_s:>10.0f}{paddle_s * 1e3:>11.1f}"
            f"{step_s / paddle_s:>11.2f}{floor_s * 1e3:>10.1f}{step_s / floor_s:>10.2f}"
        )
    bandwidth = read_bandwidth()
    read_s = floor.weight_bytes / bandwidth
    decode_1 = custom[0][3]
    print(
        f"\ndecode B=1: weights {floor.weight_bytes / 2**20:.0f} MiB, read at {bandwidth / 1e9:.1f} GB/s "
        f"in {read_s * 1e3:.1f} ms; the step takes {decode_1 * 1e3:.1f} ms = {decode_1 / read_s:.2f}x that"
    )
    for title, cases in (("custom", custom), ("paddle", paddle_cases)):
        print_breakdown(title, cases)


def print_breakdown(title: str, cases: list) -> None:
    parts = ["linear matmuls", "lm_head", "attention", "input building", "sampling"]
    print(f"\n{title}: where the median step's time goes (ms; rest = norms, activation, residual adds, python)")
    print(f"{'case':<17}" + "".join(f"{p:>16}" for p in parts) + f"{'rest':>9}")
    for name, _, _, step_s, seconds in cases:
        per_step = {part: seconds.get(part, 0.0) for part in parts}
        rest = step_s - sum(per_step.values())
        print(f"{name:<17}" + "".join(f"{per_step[p] * 1e3:>16.1f}" for p in parts) + f"{rest * 1e3:>9.1f}")


if __name__ == "__main__":
    main()
