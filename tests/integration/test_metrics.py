"""Metrics checked with real Prometheus tooling, on scheduler + model-free worker + api processes."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.processes import FakeStack, free_port, scrape

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "blockserve" / "dashboards" / "blockserve.json"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with FakeStack(tmp_path_factory.mktemp("metrics-stack")) as fake:
        yield fake.env, fake.url


def run_workload(url: str) -> int:
    """20 completions of ~40 tokens (10 blocks each) at once on a cache of 24 blocks, so some are
    preempted; returns the output tokens the api reported."""
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


@pytest.fixture(scope="module")
def known_workload(stack):
    """The workload run once on the module's stack; the usage the api reported."""
    _, url = stack
    return run_workload(url)


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


@pytest.mark.parametrize("endpoint", ["BLOCKSERVE_METRICS_PORT", "BLOCKSERVE_PORT"])
def test_every_counter_has_a_dashboard_panel(stack, endpoint):
    env, _ = stack
    text = httpx.get(f"http://127.0.0.1:{env[endpoint]}/metrics", timeout=5).text
    counters = {family.name for family in text_string_to_metric_families(text) if family.type == "counter"}
    assert counters
    expressions = " ".join(dashboard_expressions())
    assert [name for name in sorted(counters) if f"{name}_total" not in expressions] == []


@contextlib.contextmanager
def prometheus_scraping(env: dict[str, str], data_dir: Path):
    """Prometheus scraping the scheduler's and the api's /metrics every second; yields its query url."""
    assert shutil.which("prometheus"), "prometheus is missing: install Debian's prometheus package"
    port = free_port()
    config = data_dir / "prometheus.yml"
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
            f"--storage.tsdb.path={data_dir / 'data'}",
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
        yield api
    finally:
        prometheus.terminate()
        prometheus.wait(10)


def query(api: str, expr: str) -> list[dict]:
    answer = httpx.get(f"{api}/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def scraped(api: str, expr: str) -> float | None:
    """The one value of `expr`, if it has one yet."""
    result = query(api, expr)
    return float(result[0]["value"][1]) if result else None


def wait_for(condition, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"Prometheus did not {what}"
        time.sleep(0.5)


def test_real_prometheus_scrapes_both_and_every_dashboard_query_succeeds(tmp_path):
    """Every dashboard query has data: a sample, with a number, for each panel line. Prometheus scrapes
    a fresh stack before and after a workload with preemptions, so every gauge is there, every rate
    and quantile has increases in its window and each ratio a non-zero denominator (or a clamped
    one). A metric renamed in the service leaves its queries empty."""
    with FakeStack(tmp_path) as fake, prometheus_scraping(fake.env, tmp_path) as api:
        tokens = run_workload(fake.url)
        wait_for(lambda: scraped(api, "sum(blockserve_generation_tokens_total)") == tokens, "scrape the workload")
        scrapes = scraped(api, "sum(count_over_time(up[10m]))")
        # Both scraped once more: a series the workload began (a finish reason) has the two samples of a rate.
        wait_for(lambda: scraped(api, "sum(count_over_time(up[10m]))") >= scrapes + 2, "scrape both again")
        for expr in dashboard_expressions():
            result = query(api, expr.replace("$__rate_interval", "1m").replace("$model", ".*"))
            assert result, f"no data: {expr}"
            assert all(math.isfinite(float(sample["value"][1])) for sample in result), (expr, result)
        assert scraped(api, "blockserve_kv_blocks_capacity") == 24
