"""Run every kernel check on this machine's GPU without pytest: `python -m tests.gpu.check_kernels`.

Prints one line per check and element type (the KV-cache checks once more per 8-bit cache type); exits 1 if
any failed, 2 if there is no GPU.
"""

from __future__ import annotations

import sys
import time
import traceback

from tests.gpu.gpu_library import NoGpu, gpu_library
from tests.gpu.kernel_checks import CHECKS, GPU_ONLY_CHECKS
from tests.support.kernel_reference import DTYPES


def main() -> int:
    try:
        started = time.perf_counter()
        library = gpu_library()
        print(f"built the kernels in {time.perf_counter() - started:.1f} s", flush=True)
    except NoGpu as exc:
        print(f"no GPU check possible: {exc}")
        return 2
    failures = 0
    for check in CHECKS + GPU_ONLY_CHECKS:
        for dtype in DTYPES:
            started = time.perf_counter()
            try:
                check(library, dtype)
                outcome = "PASS"
            except Exception:
                failures += 1
                outcome = "FAIL\n" + traceback.format_exc(limit=3)
            print(f"{check.__name__:55s} {dtype:9s} {time.perf_counter() - started:6.1f} s {outcome}", flush=True)
    print(f"{failures} failed" if failures else "all kernel checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
