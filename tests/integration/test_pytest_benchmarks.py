"""The pytest-benchmark files in benchmarks/ run: each case once, untimed (--benchmark-disable), in a pytest of
their own (the suite's testpaths hold tests/ only)."""

import re
import subprocess
import sys

import pytest

from tests.support.processes import ROOT

BENCHMARK_FILES = {"benchmarks/bench_wire.py": 7, "benchmarks/bench_scheduler_step.py": 7}  # file: its cases


@pytest.mark.parametrize("path", BENCHMARK_FILES)
def test_each_case_of_a_pytest_benchmark_file_runs(path):
    command = [sys.executable, "-m", "pytest", path, "--benchmark-disable", "-q", "-p", "no:cacheprovider"]
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stdout[-4000:] + finished.stderr[-2000:]
    assert re.search(rf"\b{BENCHMARK_FILES[path]} passed\b", finished.stdout), finished.stdout[-2000:]
