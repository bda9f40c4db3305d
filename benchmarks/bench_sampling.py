"""Time of one step's sampling (Sampler.draw, then fetch) over SmolLM2's 49152 logits, for each kind of request
and batch size: the kernels' draw (on a CPU the custom op bs_sample_rows) against the Paddle ops it replaces
(worker/sample/paddle_draw.py, still the path of the other kernels).

Run: OMP_NUM_THREADS=2 python benchmarks/bench_sampling.py [--repeats N]

The logits are normal with standard deviation 3 (flatter than a model's: top_p keeps more candidates), the
same for both sides. Each figure is the median of --repeats draws (at most 3 of Paddle's where they take over
50 ms), the two sides taking turns per case (the machine may be shared).
"""

from __future__ import annotations

import argparse
import os
import time

from worker.host.cpu_threads import set_thread_defaults

set_thread_defaults()  # the worker's OpenMP settings, as in the service

import numpy as np  # noqa: E402
import paddle  # noqa: E402

from service.contract import wire  # noqa: E402
from worker.inputs.step_inputs import RequestState  # noqa: E402
from worker.kernels.reference import PaddleKernels  # noqa: E402
from worker.kernels.selection import select_kernels  # noqa: E402
from worker.sample.sampler import Sampler  # noqa: E402

VOCAB_SIZE = 49152
BATCHES = (1, 8, 64)
KINDS = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "min_p 0.05": {"temperature": 1.0, "min_p": 0.05},
    "top_k 50": {"temperature": 1.0, "top_k": 50},
    "top_p 0.9": {"temperature": 1.0, "top_p": 0.9},
    "top_k 50 top_p 0.95": {"temperature": 0.7, "top_k": 50, "top_p": 0.95},
    "top_p 0.9 temp 2.5": {"temperature": 2.5, "top_p": 0.9},  # flat rows: top_p keeps most of the vocabulary
}


def time_draw(sampler: Sampler, logits: paddle.Tensor, requests: list[RequestState], repeats: int) -> float:
    """Median seconds of draw + fetch (fewer repeats where one takes over 50 ms)."""
    sampler.draw(logits, requests).fetch()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        sampler.draw(logits, requests).fetch()
        times.append(time.perf_counter() - started)
        if times[-1] > 0.05 and len(times) >= 3:
            break
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    kernels = select_kernels("custom").kernels
    samplers = {
        "paddle": Sampler(seed=0, argmax=PaddleKernels().argmax_rows, sample_rows=PaddleKernels().sample_rows),
        "custom": Sampler(seed=0, argmax=kernels.argmax_rows, sample_rows=kernels.sample_rows),
    }
    print(f"Sampler.draw over {VOCAB_SIZE} logits, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, isa={kernels.isa}")
    print(f"{'kind':<22}{'batch':>6}{'paddle ms':>11}{'custom ms':>11}{'ratio':>8}")
    rng = np.random.default_rng(0)
    for batch in BATCHES:
        logits = paddle.to_tensor((rng.standard_normal((batch, VOCAB_SIZE)) * 3).astype(np.float32))
        for kind, sampling in KINDS.items():
            requests = [
                RequestState(f"r{i}", [1, 2, 3], 3, wire.SamplingParams(**sampling), [0], 3) for i in range(batch)
            ]
            seconds = {name: time_draw(sampler, logits, requests, args.repeats) for name, sampler in samplers.items()}
            ratio = seconds["paddle"] / seconds["custom"]
            print(f"{kind:<22}{batch:>6}{seconds['paddle'] * 1e3:>11.2f}{seconds['custom'] * 1e3:>11.2f}{ratio:>8.1f}")


if __name__ == "__main__":
    main()
