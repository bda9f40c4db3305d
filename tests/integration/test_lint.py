import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["service", "worker", "tests", "scripts", "benchmarks"]


def test_ruff_finds_no_lint_errors():
    checked = subprocess.run(
        [sys.executable, "-m", "ruff", "check", *SOURCES], cwd=ROOT, capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout


def test_code_is_ruff_formatted():
    checked = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", *SOURCES], cwd=ROOT, capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout
