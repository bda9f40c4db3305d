"""benchmarks/bench_step_loop.py in quick mode: the report's shape and that its numbers are sane."""

import json
import subprocess
import sys

from tests.support.processes import ROOT

PARTS = {"scheduler schedule", "scheduler update", "scheduler fanout", "worker input building"}


def test_quick_step_loop_benchmark_reports_both_modes_with_sane_numbers(tmp_path):
    report, plot = tmp_path / "step_loop.json", tmp_path / "step_loop.png"
    command = [sys.executable, "benchmarks/bench_step_loop.py", "--quick", "--mode", "both"]
    subprocess.run([*command, "--json", str(report), "--plot", str(plot)], cwd=ROOT, check=True, timeout=120)
    cases = json.loads(report.read_text())["cases"]
    assert {case["mode"] for case in cases} == {"serial", "async"}
    assert any(case["waiting"] for case in cases)
    for case in cases:
        assert 0 < case["busy_fraction"] <= 1
        assert case["errors"] == 0
        assert case["output_tokens"] == (case["running"] + case["waiting"]) * case["max_tokens"]
        assert case["num_steps"] >= case["max_tokens"]
        assert 0 <= case["gap_ms"]["p50"] <= case["gap_ms"]["p99"]
        assert case["tokens_per_s"] > 0
        assert PARTS <= case["parts_ms_per_step"].keys()
        assert all(ms >= 0 for ms in case["parts_ms_per_step"].values())
    assert plot.read_bytes().startswith(b"\x89PNG")
