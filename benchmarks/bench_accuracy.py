"""Accuracy of each worker precision against float32 on SmolLM2 (the figures of docs/worker.md's table).

Run: OMP_NUM_THREADS=2 python benchmarks/bench_accuracy.py [--precision DTYPE:QUANTIZATION ...] [--cpu-isa auto|avx2|avx512]

Mean KL divergence of the next-token distributions over the English text shipped in tests/data, and the
greedy tokens on the 8 reference prompts: teacher-forced agreement with float32's continuation (32 tokens
each) and how many free-running continuations are identical (tests/support/accuracy.py). The reference
is the custom kernels in float32 (equal to transformers within 1e-3: test_worker_vs_transformers.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from worker.host.cpu_threads import set_thread_defaults

set_thread_defaults()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the measure lives in tests/support

from service.contract.config import default_model_path  # noqa: E402
from tests.support.accuracy import Float32Reference, load_runner  # noqa: E402

PRECISIONS = ("bfloat16:none", "float32:int8", "bfloat16:int8", "float32:gguf", "bfloat16:gguf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", action="append", help=f"DTYPE:QUANTIZATION (default: {PRECISIONS})")
    parser.add_argument(
        "--cpu-isa",
        default="auto",
        choices=("auto", "avx2", "avx512", "avx512+bf16+vnni"),
        help="BLOCKSERVE_CPU_ISA of every runner",
    )
    args = parser.parse_args()
    model_path = Path(default_model_path())
    # Every runner, the reference too, on the instruction sets asked for.
    reference = Float32Reference(load_runner(model_path, "float32:none", cpu_isa=args.cpu_isa))
    rows = []
    for precision in args.precision or PRECISIONS:
        runner = load_runner(model_path, precision, cpu_isa=args.cpu_isa)
        rows.append((precision, runner.kernels["kernels_isa"], reference.accuracy_of(runner)))
    print(f"\nSmolLM2-135M ({model_path.name}) against float32, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    print(f"{'precision':<16}{'isa':<20}{'mean KL (nats)':>16}{'greedy agreement':>18}{'identical (of 8)':>18}")
    for precision, isa, accuracy in rows:
        print(
            f"{precision:<16}{isa:<20}{accuracy.mean_kl_nats:>16.5f}{accuracy.greedy_agreement:>18.3f}"
            f"{accuracy.identical_continuations:>18}"
        )


if __name__ == "__main__":
    main()
