"""Worker step time on SmolLM2 for each weight precision, against the time to read the weights.

Run: OMP_NUM_THREADS=2 python benchmarks/bench_worker.py [--steps N]
     [--precision KERNELS:DTYPE:QUANTIZATION[:ISA_CAP[:KV_CACHE_DTYPE]] ...] [--op-by-op]
     [--decode-batches B ...] [--prefills COUNTxLEN ...]
     [--temperature T] [--top-p P] [--top-k K]

Decode: B requests with a 128-token context each, one token per request per step.
Prefill: fresh prompts computed in one step (the step samples each request's first token).
Every request samples greedily unless --temperature, --top-p or --top-k say otherwise (the draw is the
breakdown's "sampling").
Every precision (default: the custom kernels in float32, bfloat16, int8 and gguf, and pure Paddle in
float32) runs every case in the same run, the precisions taking turns step by step, each timed step after
an untimed one of its own: a shared host's slow and fast minutes then fall on all of them alike, and a
ratio compares steps of the same minutes (on a 2-vCPU AMD EPYC Zen 4 VM the same bf16 GEMMs measured
330-410 GFLOP/s, and 190-215 a few minutes later). "vs f32" divides by the custom float32 step of the case.
For decode B=1, "read ms" is the time to read the weights' actual bytes (what the model holds in that
precision) once at the read bandwidth measured in this run: torch's sum over a 1 GiB array, once before
each timed B=1 step of that precision (and an untimed step between the two, as the read leaves the caches
cold), so that the read and the steps see the same moments of a shared host; the ratio uses the median of
those reads, as the step is the median step, and the line also gives the ratio at the fastest read. The
breakdown times the parts of the median step with wall-clock timers (Paddle on CPU runs ops
synchronously); inside the fused decoder stack (the default), the op clocks its own stages (time_stages;
the clocks are read after the timed step's clock stops), so the linear matmuls and the attention are the same parts in both modes. ISA_CAP (avx2, avx512, avx512+bf16+vnni; default all: BLOCKSERVE_CPU_ISA) keeps the custom ops below what the
CPU has: `custom:float32:none:avx2` and `custom:bfloat16:none:avx2` measure the AVX2 path
(bf16 storage widened to fp32 in registers) on an AVX-512 machine; `custom:bfloat16:none:avx512+bf16+vnni` beside
`custom:bfloat16:none` on a CPU with AMX measures the GEMMs without and with its tiles in the same run.
KV_CACHE_DTYPE (BLOCKSERVE_KV_CACHE_DTYPE: auto, bfloat16, float32, int8, fp8_e4m3; default auto) sets the KV cache:
`custom:auto:gguf:all:bfloat16` beside `custom:auto:gguf:all:int8` compares the caches' attention (the breakdown's
"attention": rotary, KV write and attention as the worker's fused stack runs them) step by step in one process.
The worker's OpenMP settings (worker/host/cpu_threads.py) apply, as in the service.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import time
from collections import defaultdict
from contextlib import contextmanager

from worker.host.cpu_threads import set_thread_defaults

THREAD_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")  # the OpenMP waits the run used

set_thread_defaults()

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import torch  # noqa: E402

import worker.model_runner as model_runner_module  # noqa: E402
from service.contract import wire  # noqa: E402
from service.contract.config import load_settings  # noqa: E402
from worker.model_runner import ModelRunner  # noqa: E402
from worker.models.llama_decoder_stack import STACK_STAGES, FusedDecoderStack  # noqa: E402

CONTEXT_LEN = 128
DECODE_BATCHES = (1, 8, 32, 64)
PREFILLS = ((1, 512), (4, 256))
GREEDY = wire.SamplingParams(temperature=0.0, max_tokens=1 << 20)
MODEL: str | None = None  # BLOCKSERVE_MODEL of the runs (--model); None: the default model (SmolLM2-135M)
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
        # Adds what was clocked elsewhere (the fused stack's own stage clock) to `seconds`: called after a
        # timed step, outside its time, and before one, to drop what untimed steps clocked.
        self.settle = lambda: None

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
        timers.settle = stage_settler(fused, timers)
    else:
        linears = ("qkv", "o", "gate_up", "down")
        model.layers = [
            dataclasses.replace(
                layer,
                **{
                    name: timers.wrap("linear matmuls", getattr(layer, name))
                    for name in linears
                    if getattr(layer, name) is not None  # a mixture of experts' layer without shared experts
                },
            )
            for layer in model.layers
        ]
        runner.attention.attend_qkv = timers.wrap("attention", runner.attention.attend_qkv)  # rope, KV write, attention
    # The step's inputs and its attention's metadata; this runner's own (build_step_inputs is the module's, which
    # every runner of a run shares).
    runner._prepared = timers.wrap("input building", runner._prepared)
    model.compute_logits = timers.wrap("lm_head", model.compute_logits)
    runner.sampler.draw = timers.wrap("sampling", runner.sampler.draw)


def stage_settler(stack: FusedDecoderStack, timers: Timers):
    """Adds what `stack`'s stages spent since the last call to the linear matmuls and the attention."""
    read = stack.stage_seconds.copy()

    def settle():
        nonlocal read
        spent = dict(zip(STACK_STAGES, stack.stage_seconds - read))
        read = stack.stage_seconds.copy()
        timers.seconds["linear matmuls"] += sum(spent[stage] for stage in LINEAR_STAGES)
        timers.seconds["attention"] += sum(spent[stage] for stage in ATTENTION_STAGES)

    return settle


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

    def measure(self) -> float:
        """Reads the array once; its bandwidth (bytes per second), also kept in `bandwidths`."""
        started = time.perf_counter()
        self.array.sum()
        self.bandwidths.append(self.array.numel() * self.array.element_size() / (time.perf_counter() - started))
        return self.bandwidths[-1]


def turns(count: int, rounds: int) -> list[list[int]]:
    """The order in which `count` precisions take each of `rounds` turns: every one once a round, the first
    place rotating, so that no precision always follows the same one."""
    return [[(start + i) % count for i in range(count)] for start in range(rounds)]


def median_steps(count: int, rounds: int, timed_turn) -> list[tuple[float, dict[str, float], list[float]]]:
    """For each of `count` subjects, the (seconds, seconds per part) of its median step (the machine is shared
    and noisy) over `rounds` rounds of turns, and the attention seconds of each round's step (round by round, so
    that subjects can be compared in the steps that took turns); `timed_turn(index)` runs subject index's turn and
    returns the record of its timed step."""
    records: list[list] = [[] for _ in range(count)]
    for order in turns(count, rounds):
        for index in order:
            records[index].append(timed_turn(index))
    return [
        (*sorted(own, key=lambda record: record[0])[len(own) // 2], [parts.get("attention", 0.0) for _, parts in own])
        for own in records
    ]


@dataclasses.dataclass
class Subject:
    """One precision under test: its runner, the timers of its parts and the requests it serves."""

    name: str  # KERNELS:DTYPE:QUANTIZATION[:ISA_CAP[:KV_CACHE_DTYPE]] as asked
    runner: ModelRunner
    timers: Timers
    workload: Workload
    weight_bytes: int  # what the model's weights hold in this precision
    read_bandwidths: list[float] = dataclasses.field(default_factory=list)  # one per timed decode B=1 step

    def timed(self, run_step) -> tuple[float, dict[str, float]]:
        self.timers.settle()
        self.timers.seconds.clear()
        started = time.perf_counter()
        run_step()
        seconds = time.perf_counter() - started
        self.timers.settle()
        return seconds, dict(self.timers.seconds)


def subject_of(name: str, op_by_op: bool, sampling: wire.SamplingParams = GREEDY) -> Subject:
    kernels, dtype, quantization, *rest = name.split(":")
    cap = rest[0] if rest else "all"
    cpu_isa = {"all": "auto"}.get(cap, cap)  # BLOCKSERVE_CPU_ISA
    kv_cache_dtype = rest[1] if len(rest) > 1 else "auto"  # BLOCKSERVE_KV_CACHE_DTYPE
    model = {"model": MODEL} if MODEL else {}
    runner = ModelRunner(
        load_settings(
            num_kv_blocks=1024,
            kernels=kernels,
            cpu_isa=cpu_isa,
            dtype=dtype,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            **model,
        )
    )
    assert runner.kernels["kernels"] == kernels, runner.kernels
    if op_by_op and kernels == "custom":
        runner.model.kernels.fuse_layers = False
    weight_bytes = runner.model.weight_bytes()  # before the timers wrap the layers' linears
    timers = Timers()
    instrument(runner, timers)
    return Subject(name, runner, timers, Workload(runner, sampling), weight_bytes)


def time_decode(subjects: list[Subject], batch: int, steps: int, probe: ReadProbe) -> list[tuple[float, dict]]:
    """Each subject's median decode step of `batch` requests. The subjects take turns step by step, so that a
    shared host's slow and fast moments fall on all of them alike; each timed step follows an untimed step of
    its own subject, as a step follows a step in the service. At B=1 a read (`probe`) comes before that
    untimed step: the read leaves every cache cold, and its bandwidth is the one the step is held against."""
    decodes = []
    for subject in subjects:
        requests = subject.workload.new_requests(batch, CONTEXT_LEN, room=2 * steps + 2)
        for first in range(0, batch, 8):  # prefill a few at a time, untimed
            subject.workload.step(new_requests=requests[first : first + 8])
        decodes.append([wire.RunningRequest(r.request_id, [], 1) for r in requests])

    def timed_turn(index: int):
        subject, decode = subjects[index], decodes[index]
        if batch == 1:
            subject.read_bandwidths.append(probe.measure())
        subject.workload.step(running_requests=decode)
        return subject.timed(lambda: subject.workload.step(running_requests=decode))

    medians = median_steps(len(subjects), steps, timed_turn)
    for subject, decode in zip(subjects, decodes):
        subject.workload.step(finished_request_ids=[r.request_id for r in decode])
    return medians


def time_prefill(subjects: list[Subject], count: int, prompt_len: int, steps: int) -> list[tuple[float, dict]]:
    """Each subject's median step computing `count` fresh prompts of `prompt_len` tokens, the subjects taking
    turns; a timed step follows the untimed step that finished the prompts before (another subject's)."""
    batches = []
    for subject in subjects:
        warm_up = subject.workload.new_requests(count, prompt_len, room=1)
        subject.workload.step(new_requests=warm_up)
        subject.workload.step(finished_request_ids=[r.request_id for r in warm_up])
        batches.append([subject.workload.new_requests(count, prompt_len, room=1) for _ in range(steps)])

    def timed_turn(index: int):
        subject, requests = subjects[index], batches[index].pop()
        record = subject.timed(lambda: subject.workload.step(new_requests=requests))
        subject.workload.step(finished_request_ids=[r.request_id for r in requests])
        return record

    return median_steps(len(subjects), steps, timed_turn)


@dataclasses.dataclass
class PrecisionRun:
    name: str  # KERNELS:DTYPE:QUANTIZATION[:ISA_CAP[:KV_CACHE_DTYPE]] as asked
    described: dict[str, str]  # what the worker reports it chose
    kv_cache_dtype: str  # what its KV cache holds
    weight_bytes: int
    # (case, tokens per step, median step s, its s per part, attention s of each round's step)
    cases: list[tuple[str, int, float, dict[str, float], list[float]]]
    read_bandwidths: list[float]  # bytes per second, read once before each timed decode B=1 step


def run_precisions(
    names: list[str],
    steps: int,
    op_by_op: bool,
    probe: ReadProbe,
    sampling: wire.SamplingParams = GREEDY,
    decode_batches: tuple[int, ...] = DECODE_BATCHES,
    prefills: tuple[tuple[int, int], ...] = PREFILLS,
) -> list[PrecisionRun]:
    """Every case (decode batches, prefills) for every precision in `names`, the precisions taking turns step by
    step."""
    subjects = [subject_of(name, op_by_op, sampling) for name in names]
    cases: list[list] = [[] for _ in subjects]
    for batch in decode_batches:
        for own, record in zip(cases, time_decode(subjects, batch, steps, probe)):
            own.append((f"decode B={batch}", batch, *record))
    for count, prompt_len in prefills:
        for own, record in zip(cases, time_prefill(subjects, count, prompt_len, max(3, steps // 3))):
            own.append((f"prefill {count}x{prompt_len}", count * prompt_len, *record))
    return [
        PrecisionRun(
            subject.name,
            subject.runner.kernels,
            subject.runner.kv_cache.dtype,
            subject.weight_bytes,
            own,
            subject.read_bandwidths,
        )
        for subject, own in zip(subjects, cases)
    ]


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
        "--precision",
        action="append",
        help=f"KERNELS:DTYPE:QUANTIZATION[:ISA_CAP[:KV_CACHE_DTYPE]] (default: {PRECISIONS})",
    )
    parser.add_argument("--op-by-op", action="store_true", help="custom kernels: layers op by op, timed by part")
    parser.add_argument(
        "--decode-batches", type=int, nargs="*", default=list(DECODE_BATCHES), help="decode cases: requests per step"
    )
    parser.add_argument(
        "--prefills", nargs="*", default=[f"{c}x{n}" for c, n in PREFILLS], help="prefill cases: COUNTxPROMPT_LEN"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="every request's (default 0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="every request's (default 1: none)")
    parser.add_argument("--top-k", type=int, default=0, help="every request's (default 0: none)")
    parser.add_argument("--model", help="a GGUF file or Hugging Face folder (default: SmolLM2-135M)")
    args = parser.parse_args()
    global MODEL
    MODEL = args.model
    sampling = wire.SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=GREEDY.max_tokens
    )
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    probe = ReadProbe()
    prefills = tuple(tuple(int(part) for part in case.split("x")) for case in args.prefills)
    runs = run_precisions(
        args.precision or list(PRECISIONS),
        args.steps,
        args.op_by_op,
        probe,
        sampling,
        tuple(args.decode_batches),
        prefills,
    )
    reference = next((run for run in runs if run.name == "custom:float32:none"), runs[0])
    print(
        f"\n{MODEL or 'SmolLM2-135M'} on {cpu_name()}, Paddle {paddle.__version__}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, "
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
    if 1 in args.decode_batches:
        print_read_ratios(runs, args.decode_batches.index(1))
    print_attention(runs, reference)
    for run in runs:
        print_breakdown(run)


def print_read_ratios(runs: list[PrecisionRun], case_index: int) -> None:
    print(
        "\ndecode B=1 against reading the weights once (goal: step <= 1.5x read) at the median of the reads"
        " taken before each of the precision's B=1 steps (in brackets: at the fastest of them)"
    )
    for run in runs:
        median_read, fastest_read = float(np.median(run.read_bandwidths)), max(run.read_bandwidths)
        read_s, step_s = run.weight_bytes / median_read, run.cases[case_index][2]
        print(
            f"{run.name:<27} dtype={run.described['dtype']:<9} kv={run.kv_cache_dtype:<9} isa={run.described.get('kernels_isa', '-'):<22} weights {run.weight_bytes / 2**20:6.1f} MiB, "
            f"read at {median_read / 1e9:4.1f} GB/s {read_s * 1e3:5.1f} ms, step {step_s * 1e3:6.1f} ms = {step_s / read_s:.2f}x "
            f"(at {fastest_read / 1e9:4.1f} GB/s: {step_s * fastest_read / run.weight_bytes:.2f}x)"
        )


def print_attention(runs: list[PrecisionRun], reference: PrecisionRun) -> None:
    """The attention part of each median step (rotary, KV write, attention) beside the reference's: with KV caches
    of two dtypes, the caches' attention compared in steps that took turns."""
    print(
        f"\nattention ms of the median step (vs {reference.name}; KV cache: "
        + ", ".join(f"{run.kv_cache_dtype}" for run in runs)
        + ")"
    )
    print(f"{'case':<16}" + "".join(f"{run.name:>34}" for run in runs))
    for index, (case, *_) in enumerate(reference.cases):
        reference_s = reference.cases[index][3].get("attention", 0.0)
        cells = []
        for run in runs:
            attention_s = run.cases[index][3].get("attention", 0.0)
            ratio = f"{attention_s / reference_s:.2f}x" if reference_s > 0 else "-"
            cells.append(f"{attention_s * 1e3:.2f} ({ratio})")
        print(f"{case:<16}" + "".join(f"{cell:>34}" for cell in cells))
    print(
        f"attention paired by round: the median over rounds of each round's attention / {reference.name}'s"
        " (the steps that took turns; steadier than the median steps' ratio on a host whose speed moves)"
    )
    for index, (case, *_) in enumerate(reference.cases):
        reference_rounds = reference.cases[index][4]
        cells = []
        for run in runs:
            pairs = [own / theirs for own, theirs in zip(run.cases[index][4], reference_rounds) if theirs > 0]
            cells.append(f"{np.median(pairs):.3f}x" if pairs else "-")
        print(f"{case:<16}" + "".join(f"{cell:>34}" for cell in cells))


def print_breakdown(run: PrecisionRun) -> None:
    print(f"\n{run.name}: where the median step's time goes (ms; rest = embedding, the norms, the activation, python)")
    print(f"{'case':<16}" + "".join(f"{part:>16}" for part in PARTS) + f"{'rest':>9}{'attention %':>13}")
    for case, _, step_s, seconds, _ in run.cases:
        per_step = {part: seconds.get(part, 0.0) for part in PARTS}
        rest = step_s - sum(per_step.values())
        share = f"{100 * per_step['attention'] / step_s:>12.1f}%" if per_step["attention"] else f"{'-':>13}"
        print(
            f"{case:<16}" + "".join(f"{per_step[part] * 1e3:>16.1f}" for part in PARTS) + f"{rest * 1e3:>9.1f}{share}"
        )


if __name__ == "__main__":
    main()
