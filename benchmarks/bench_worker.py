"""Worker step time on SmolLM2 for each weight precision, against the time to read the weights.

Run: OMP_NUM_THREADS=2 python benchmarks/bench_worker.py [--steps N]
     [--precision KERNELS:DTYPE:QUANTIZATION[:ISA_CAP] ...] [--op-by-op]
     [--temperature T] [--top-p P] [--top-k K]

Decode: B requests with a 128-token context each, one token per request per step.
Prefill: fresh prompts computed in one step (the step samples each request's first token).
Every request samples greedily unless --temperature, --top-p or --top-k say otherwise (the draw is the
breakdown's "sampling").
Every precision (default: the custom kernels in float32, bfloat16, int8 and gguf, and pure Paddle in
float32) runs every case in the same run; "vs f32" divides by the custom float32 step of the case.
For decode B=1, "read ms" is the time to read the weights' actual bytes (what the model holds in that
precision) once at the read bandwidth measured in this run: torch's sum over a 1 GiB array, once before
each timed B=1 step of that precision (and an untimed step between the two, as the read leaves the caches
cold), so that the read and the steps see the same moments of a shared host; the ratio uses the median of
those reads, as the step is the median step, and the line also gives the ratio at the fastest read. The
breakdown times the parts of the median step with wall-clock timers (Paddle on CPU runs ops
synchronously); inside the fused decoder stack (the default), the op clocks its own stages (time_stages),
so the linear matmuls and the attention are the same parts in both modes. ISA_CAP (avx2, avx512; default all: BLOCKSERVE_CPU_ISA) keeps the custom ops below what the
CPU has: `custom:float32:none:avx2` and `custom:bfloat16:none:avx2` measure the AVX2 path
(bf16 storage widened to fp32 in registers) on an AVX-512 machine. The worker's OpenMP settings (gpu_worker/cpu_threads.py) apply, as in the service.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import time
from collections import defaultdict
from contextlib import contextmanager

from gpu_worker.cpu_threads import set_thread_defaults

THREAD_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")  # the OpenMP waits the run used

set_thread_defaults()

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import torch  # noqa: E402

import gpu_worker.model_runner as model_runner_module  # noqa: E402
from gpu_worker.kernels import STACK_STAGES, FusedDecoderStack  # noqa: E402
from gpu_worker.model_runner import ModelRunner  # noqa: E402
from gpu_worker.step_inputs import build_step_inputs  # noqa: E402
from service import wire  # noqa: E402
from service.config import load_settings  # noqa: E402

CONTEXT_LEN = 128
DECODE_BATCHES = (1, 8, 32, 64)
PREFILLS = ((1, 512), (4, 256))
GREEDY = wire.SamplingParams(temperature=0.0, max_tokens=1 << 20)
PRECISIONS = (
    "custom:float32:none",
    "custom:bfloat16:none",
    "custom:auto:int8",
    "custom:auto:gguf",
    "paddle:float32:none",
)
PARTS = ("linear matmuls", "attention", "lm_head", "input building", "sampling")
LINEAR_STAGES = ("qkv", "o", "gate_up", "down")
ATTENTION_STAGES = ("rope + KV write", "attention")  # as op by op: attend_qkv


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
    fused = model.kernels.fused_stack(runner.attention, model.config)
    if fused is not None:
        fused.time_stages = True
        timed = stack_timed_by_stage(fused, timers)
        model.kernels.fused_stack = lambda *_: timed
    else:
        linears = ("qkv", "o", "gate_up", "down")
        model.layers = [
            dataclasses.replace(
                layer, **{name: timers.wrap("linear matmuls", getattr(layer, name)) for name in linears}
            )
            for layer in model.layers
        ]
        runner.attention.attend_qkv = timers.wrap("attention", runner.attention.attend_qkv)  # rope, KV write, attention
    runner.attention.prepare = timers.wrap("input building", runner.attention.prepare)
    model_runner_module.build_step_inputs = timers.wrap("input building", build_step_inputs)
    model.compute_logits = timers.wrap("lm_head", model.compute_logits)
    runner.sampler.draw = timers.wrap("sampling", runner.sampler.draw)


def stack_timed_by_stage(stack: FusedDecoderStack, timers: Timers):
    """`stack`, adding what its stages spent in each call to the linear matmuls and the attention."""

    def run(*args):
        before = stack.stage_seconds.copy()
        hidden = stack(*args)
        spent = dict(zip(STACK_STAGES, stack.stage_seconds - before))
        timers.seconds["linear matmuls"] += sum(spent[stage] for stage in LINEAR_STAGES)
        timers.seconds["attention"] += sum(spent[stage] for stage in ATTENTION_STAGES)
        return hidden

    return run


class Workload:
    """Hands out request ids and blocks, and builds the steps of one benchmark case."""

    def __init__(self, runner: ModelRunner, sampling: wire.SamplingParams = GREEDY):
        self.runner = runner
        self.sampling = sampling  # every request's
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
                sampling=self.sampling,
                block_ids=list(range(i * blocks_each, (i + 1) * blocks_each)),
                num_computed_tokens=0,
                num_scheduled_tokens=prompt_len,
            )
            for i in range(count)
        ]


class ReadProbe:
    """The read bandwidth of this moment: torch sums a 1 GiB array (far past any cache) once."""

    def __init__(self):
        self.array = torch.ones(2**28)
        self.array.sum()
        self.bandwidths: list[float] = []  # bytes per second, one per measure()

    def measure(self) -> None:
        started = time.perf_counter()
        self.array.sum()
        self.bandwidths.append(self.array.numel() * self.array.element_size() / (time.perf_counter() - started))


def median_step(run_step, steps: int, timers: Timers, before_each=None) -> tuple[float, dict[str, float]]:
    """(seconds, seconds per part) of the step with the median time; the machine is shared and noisy.
    `before_each` (untimed) runs before every timed step."""
    records = []
    for _ in range(steps):
        if before_each is not None:
            before_each()
        timers.seconds.clear()
        started = time.perf_counter()
        run_step()
        records.append((time.perf_counter() - started, dict(timers.seconds)))
    return sorted(records, key=lambda record: record[0])[len(records) // 2]


def time_decode(workload: Workload, batch: int, steps: int, timers: Timers, probe: ReadProbe | None = None):
    """The median decode step; with `probe`, a read before each timed step, then an untimed step (the read
    leaves every cache cold: the timed step follows a step, as in a run without reads)."""
    requests = workload.new_requests(batch, CONTEXT_LEN, room=2 * steps + 2)
    for first in range(0, batch, 8):  # prefill a few at a time, untimed
        workload.step(new_requests=requests[first : first + 8])
    decode = [wire.RunningRequest(r.request_id, [], 1) for r in requests]
    workload.step(running_requests=decode)

    def read_then_step():
        probe.measure()
        workload.step(running_requests=decode)

    before_each = read_then_step if probe is not None else None
    record = median_step(lambda: workload.step(running_requests=decode), steps, timers, before_each)
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


@dataclasses.dataclass
class PrecisionRun:
    name: str  # KERNELS:DTYPE:QUANTIZATION as asked
    described: dict[str, str]  # what the worker reports it chose
    weight_bytes: int
    cases: list[tuple[str, int, float, dict[str, float]]]  # (case, tokens per step, median step s, s per part)
    read_bandwidths: list[float]  # bytes per second, read once before each timed decode B=1 step


def run_precision(
    name: str, steps: int, op_by_op: bool, probe: ReadProbe, sampling: wire.SamplingParams = GREEDY
) -> PrecisionRun:
    kernels, dtype, quantization, *cap = name.split(":")
    cpu_isa = {"all": "auto"}.get(cap[0], cap[0]) if cap else "auto"  # BLOCKSERVE_CPU_ISA
    runner = ModelRunner(
        load_settings(num_kv_blocks=1024, kernels=kernels, cpu_isa=cpu_isa, dtype=dtype, quantization=quantization)
    )
    assert runner.kernels["kernels"] == kernels, runner.kernels
    if op_by_op and kernels == "custom":
        runner.model.kernels.fuse_layers = False
    weight_bytes = runner.model.weight_bytes()
    timers = Timers()
    instrument(runner, timers)
    workload = Workload(runner, sampling)
    cases = []
    probe.bandwidths = []
    for batch in DECODE_BATCHES:
        batch_probe = probe if batch == 1 else None
        cases.append((f"decode B={batch}", batch, *time_decode(workload, batch, steps, timers, batch_probe)))
    for count, prompt_len in PREFILLS:
        record = time_prefill(workload, count, prompt_len, max(3, steps // 3), timers)
        cases.append((f"prefill {count}x{prompt_len}", count * prompt_len, *record))
    return PrecisionRun(name, runner.kernels, weight_bytes, cases, probe.bandwidths)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=9, help="timed steps per decode case (the median is shown)")
    parser.add_argument(
        "--precision", action="append", help=f"KERNELS:DTYPE:QUANTIZATION[:ISA_CAP] (default: {PRECISIONS})"
    )
    parser.add_argument("--op-by-op", action="store_true", help="custom kernels: layers op by op, timed by part")
    parser.add_argument("--temperature", type=float, default=0.0, help="every request's (default 0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="every request's (default 1: none)")
    parser.add_argument("--top-k", type=int, default=0, help="every request's (default 0: none)")
    args = parser.parse_args()
    sampling = wire.SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=GREEDY.max_tokens
    )
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    probe = ReadProbe()
    runs = [run_precision(name, args.steps, args.op_by_op, probe, sampling) for name in args.precision or PRECISIONS]
    reference = next((run for run in runs if run.name == "custom:float32:none"), runs[0])
    print(
        f"\nSmolLM2-135M on {cpu_name()}, Paddle {paddle.__version__}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, "
        + "".join(f"{name}={os.environ[name]}, " for name in THREAD_VARIABLES if name in os.environ)
        + "kernels of the first run: "
        + " ".join(
            f"{key}={value}" for key, value in runs[0].described.items() if key in ("kernels_isa", "cpu_features")
        )
    )
    # An editable install imports its own checkout, not this script's: A/B runs from a worktree need
    # PYTHONPATH=<worktree>, and this line shows which code ran.
    print(f"code: {os.path.dirname(os.path.dirname(os.path.abspath(model_runner_module.__file__)))}")
    print(
        "sampling: "
        + ("greedy" if sampling.temperature == 0 else f"temperature {sampling.temperature}")
        + (f", top_p {sampling.top_p}" if sampling.top_p < 1 else "")
        + (f", top_k {sampling.top_k}" if sampling.top_k > 0 else "")
    )
    print(f"\nstep ms (tokens/s; vs {reference.name})")
    print(f"{'case':<16}" + "".join(f"{run.name:>34}" for run in runs))
    for index, (case, num_tokens, *_) in enumerate(reference.cases):
        cells = []
        for run in runs:
            step_s = run.cases[index][2]
            cells.append(f"{step_s * 1e3:.1f} ({num_tokens / step_s:.0f}; {step_s / reference.cases[index][2]:.2f}x)")
        print(f"{case:<16}" + "".join(f"{cell:>34}" for cell in cells))
    print(
        "\ndecode B=1 against reading the weights once (goal: step <= 1.5x read) at the median of the reads"
        " taken before each of the precision's B=1 steps (in brackets: at the fastest of them)"
    )
    for run in runs:
        median_read, fastest_read = float(np.median(run.read_bandwidths)), max(run.read_bandwidths)
        read_s, step_s = run.weight_bytes / median_read, run.cases[0][2]
        print(
            f"{run.name:<27} dtype={run.described['dtype']:<9} isa={run.described.get('kernels_isa', '-'):<22} weights {run.weight_bytes / 2**20:6.1f} MiB, "
            f"read at {median_read / 1e9:4.1f} GB/s {read_s * 1e3:5.1f} ms, step {step_s * 1e3:6.1f} ms = {step_s / read_s:.2f}x "
            f"(at {fastest_read / 1e9:4.1f} GB/s: {step_s * fastest_read / run.weight_bytes:.2f}x)"
        )
    for run in runs:
        print_breakdown(run)


def print_breakdown(run: PrecisionRun) -> None:
    print(f"\n{run.name}: where the median step's time goes (ms; rest = embedding, the norms, the activation, python)")
    print(f"{'case':<16}" + "".join(f"{part:>16}" for part in PARTS) + f"{'rest':>9}{'attention %':>13}")
    for case, _, step_s, seconds in run.cases:
        per_step = {part: seconds.get(part, 0.0) for part in PARTS}
        rest = step_s - sum(per_step.values())
        share = f"{100 * per_step['attention'] / step_s:>12.0f}%" if per_step["attention"] else f"{'-':>13}"
        print(
            f"{case:<16}" + "".join(f"{per_step[part] * 1e3:>16.1f}" for part in PARTS) + f"{rest * 1e3:>9.1f}{share}"
        )


if __name__ == "__main__":
    main()
