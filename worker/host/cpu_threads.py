"""OpenMP settings of the worker process, set before Paddle and the custom ops load their runtimes.

The worker holds two OpenMP runtimes: GNU libgomp (the custom ops) and Intel's libiomp5 (Paddle's MKL).
- libiomp5 spins for 200 ms after each parallel region by default. Paddle's few MKL calls are far
  apart, so that spinning only holds a core that the custom ops' threads need: KMP_BLOCKTIME=0.
- libgomp's threads meet at a barrier per parallel region, and a step makes about a hundred (each
  GEMM, attention, per layer). Waiting passively there puts each thread to sleep and wakes it through
  the kernel a few microseconds later, over and over. Earlier (OMP_WAIT_POLICY=PASSIVE) that cost a
  third of a one-sequence decode step. GOMP_SPINCOUNT bounds the spinning instead: 300,000 rounds,
  libgomp's own default, about 8 ms on a 2-core AMD EPYC. A thread spins across the gaps inside a
  step and sleeps between steps once the worker is idle.
Measured (benchmarks/bench_worker.py and `blockserve bench`, docs/worker.md, "Weights as they ship") on that EPYC with the
scheduler and api on the same cores. Variables already set win, and a set OMP_WAIT_POLICY keeps its
own spin count.
"""

from __future__ import annotations

import os

THREAD_DEFAULTS = {"KMP_BLOCKTIME": "0"}
GOMP_SPIN_ROUNDS = "300000"


def set_thread_defaults() -> None:
    """OMP_NUM_THREADS = the CPUs, libiomp5 waits passively, libgomp spins a bounded while; unless set."""
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    for name, value in THREAD_DEFAULTS.items():
        os.environ.setdefault(name, value)
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPIN_ROUNDS)
