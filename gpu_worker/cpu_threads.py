"""OpenMP settings of the worker process, set before Paddle and the custom ops load their runtimes.

The worker holds two OpenMP runtimes: GNU libgomp (the custom ops) and Intel's libiomp5 (Paddle's MKL).
Both spin at their barriers by default (libgomp for ~300,000 rounds, libiomp5 for 200 ms after each
parallel region). On cores shared with other processes (the scheduler and api of `blockserve serve`,
anything else on the node), a spinning thread holds the core its descheduled partner needs: measured
on a shared 2-core EPYC, one small bs_linear call on 2 threads took 5.5 ms with spinning and 29 us with
passive waits (12 us on 1 thread). Variables already set win.
"""

from __future__ import annotations

import os

THREAD_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}


def set_thread_defaults() -> None:
    """OMP_NUM_THREADS = the CPUs, and passive waits, unless the environment says otherwise."""
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    for name, value in THREAD_DEFAULTS.items():
        os.environ.setdefault(name, value)
