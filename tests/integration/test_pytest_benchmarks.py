"""The pytest-benchmark files in benchmarks/ run: each case once, untimed (--benchmark-disable), in a pytest of
their own (the suite's testpaths hold tests/ only)."""

import re
import subprocess
import sys

from tests.support.processes import ROOT

BENCHMARK_FILES = ["benchmarks/bench_wire.py", "benchmarks/bench_scheduler_step.py"]
NUM_CASES = 7 + 7


def test_every_case_of_the_pytest_benchmark_files_runs():
    command = [sys.executable, "-m", "pytest", *BENCHMARK_FILES, "--benchmark-disable", "-q", "-p", "no:cacheprovider"]
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stdout[-4000:] + finished.stderr[-2000:]
    assert re.search(rf"\b{NUM_CASES} passed\b", finished.stdout), finished.stdout[-2000:]
