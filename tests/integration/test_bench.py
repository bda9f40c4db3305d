"""`blockserve bench` against a running server (scheduler + api, model-free worker)."""

import json
import subprocess
import sys

import pytest

from tests.support.processes import ROOT, FakeStack, scrape


@pytest.fixture
def server(tmp_path):
    with FakeStack(tmp_path) as stack:
        yield stack.env, stack.url


def test_bench_report_is_well_formed_and_agrees_with_the_server_metrics(server, tmp_path):
    env, url = server
    metrics_url = f"http://127.0.0.1:{env['BLOCKSERVE_METRICS_PORT']}/metrics"
    before = scrape(env["BLOCKSERVE_METRICS_PORT"])
    result_dir = tmp_path / "result"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "service.launch.cli",
            "bench",
            "--url",
            url,
            "--metrics-url",
            metrics_url,
            "--workload",
            "custom",
            "--length-kind",
            "uniform",
            "--input-len",
            "8",
            "--output-len",
            "10",
            "--num-requests",
            "16",
            "--request-rate",
            "40",
            "--vocab-size",
            "300",
            "--slo-ttft-ms",
            "60000",
            "--result-dir",
            str(result_dir),
            "--temperature",
            "0.8",
            "--top-p",
            "0.9",
        ],
        check=True,
        cwd=ROOT,
        timeout=120,
        capture_output=True,
    )
    result = json.loads((result_dir / "result.json").read_text())
    report = result["report"]
    after = scrape(env["BLOCKSERVE_METRICS_PORT"])
    generated = after["blockserve_generation_tokens_total"] - before["blockserve_generation_tokens_total"]
    assert result["sampling"] == {"temperature": 0.8, "top_p": 0.9}  # sent with every request, all accepted
    assert report["num_requests"] == report["num_completed"] == 16 and report["num_failed"] == 0
    assert report["total_output_tokens"] == generated == result["server"]["generation_tokens"]
    assert (
        result["server"]["preemptions"]
        == after["blockserve_num_preemptions_total"] - before["blockserve_num_preemptions_total"]
    )
    assert report["goodput_requests_per_s"] == pytest.approx(report["requests_per_s"])
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert 0 < report[name]["p50"] <= report[name]["p99"]
    assert (result_dir / "latency_cdf.png").stat().st_size > 0
    assert (result_dir / "kv_usage.png").stat().st_size > 0
