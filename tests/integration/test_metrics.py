"""Metrics checked with real Prometheus tooling, on scheduler + model-free worker + api processes."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.processes import FakeStack, free_port, scrape

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "blockserve" / "dashboards" / "blockserve.json"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with FakeStack(tmp_path_factory.mktemp("metrics-stack")) as fake:
        yield fake.env, fake.url


@pytest.fixture(scope="module")
def known_workload(stack):
    """20 completions of ~40 tokens (10 blocks each) on a cache of 24 blocks; returns the usage the api reported."""
    _, url = stack
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id

    def one(index: int) -> int:
        completion = client.completions.create(
            model=model,
            prompt=f"request number {index} says hello",
            max_tokens=32 + index % 5,
            extra_body={"ignore_eos": True},
        )
        return completion.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        return sum(pool.map(one, range(20)))


def promtool_check(text: str) -> subprocess.CompletedProcess:
    assert shutil.which("promtool"), "promtool is missing: install Debian's prometheus package"
    return subprocess.run(["promtool", "check", "metrics"], input=text, text=True, capture_output=True)


@pytest.mark.parametrize("endpoint", ["BLOCKSERVE_METRICS_PORT", "BLOCKSERVE_PORT"])
def test_promtool_accepts_both_metrics_endpoints(stack, known_workload, endpoint):
    env, _ = stack
    text = httpx.get(f"http://127.0.0.1:{env[endpoint]}/metrics", timeout=5).text
    checked = promtool_check(text)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "blockserve_" in text


def test_figures_agree_with_the_workload_and_idle_state(stack, known_workload):
    env, _ = stack
    samples = scrape(env["BLOCKSERVE_METRICS_PORT"])
    assert samples["blockserve_generation_tokens_total"] == known_workload
    assert samples["blockserve_num_preemptions_total"] > 0
    assert samples["blockserve_request_preemptions_sum"] == samples["blockserve_num_preemptions_total"]
    assert samples["blockserve_request_preemptions_count"] == 20
    assert samples["blockserve_e2e_request_latency_seconds_count"] == 20
    assert samples["blockserve_kv_cache_usage_ratio"] == 0.0
    assert samples["blockserve_kv_blocks_free"] == samples["blockserve_kv_blocks_capacity"] == 24
    assert samples["blockserve_num_requests_running"] == samples["blockserve_num_requests_waiting"] == 0
    api = scrape(env["BLOCKSERVE_PORT"])
    assert api["blockserve_api_http_requests_total"] >= 20


def dashboard_expressions() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


def test_real_prometheus_scrapes_both_and_every_dashboard_query_succeeds(stack, known_workload, tmp_path):
    env, _ = stack
    assert shutil.which("prometheus"), "prometheus is missing: install Debian's prometheus package"
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: scheduler\n    static_configs: [{{targets: ['127.0.0.1:{env['BLOCKSERVE_METRICS_PORT']}']}}]\n"
        f"  - job_name: api\n    static_configs: [{{targets: ['127.0.0.1:{env['BLOCKSERVE_PORT']}']}}]\n"
    )
    prometheus = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                targets = httpx.get(f"{api}/targets", timeout=2).json()["data"]["activeTargets"]
                if len(targets) == 2 and all(t["health"] == "up" for t in targets):
                    break
            except (httpx.HTTPError, ValueError):  # not up yet, or still answering "Service Unavailable"
                pass
            assert time.monotonic() < deadline, "Prometheus did not scrape both targets"
            time.sleep(0.5)
        time.sleep(3)  # a few scrapes, so rate() has two points
        for expr in dashboard_expressions():
            query = expr.replace("$__rate_interval", "1m").replace("$model", ".*")
            answer = httpx.get(f"{api}/query", params={"query": query}, timeout=10).json()
            assert answer["status"] == "success", (expr, answer)
        usage = httpx.get(f"{api}/query", params={"query": "blockserve_kv_blocks_capacity"}, timeout=10).json()
        assert float(usage["data"]["result"][0]["value"][1]) == 24
    finally:
        prometheus.terminate()
        prometheus.wait(10)
