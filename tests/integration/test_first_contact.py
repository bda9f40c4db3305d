"""What a newcomer and an operator meet first, on `blockserve serve` with the real model.

- the README's usage examples, taken from README.md at test time and run as written (only the
  port is this test's);
- the metrics of a freshly started service, before any generation: every series there at 0;
- the OpenAPI document against the server (Schemathesis with every check, bounded in time).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from schemathesis.core.warnings import SchemathesisWarning

from tests.support.processes import ROOT, loopback_env, start, stop, wait_ready

README = ROOT / "README.md"
README_ADDRESS = "localhost:8000"  # the default port of `blockserve serve`, as the README's examples use it
MODEL_NAME = "SmolLM2-135M-Instruct"
CONFORMANCE_BUDGET_S = 50
MAX_RESPONSE_S = 60  # the bound of Schemathesis' response-time check: a few tokens, on a loaded 2-core machine
# Warnings about the spec itself stay on (and fail the run: "No issues found" is asserted). Off:
# the three that judge the share of generated cases the server accepted: most generated requests
# are invalid on purpose, and how many cases an operation gets in the time budget varies, so "none
# of them succeeded" comes and goes. (Every valid request must be accepted: the positive-data check.)
SHARE_ACCEPTED_WARNINGS = {"validation_mismatch", "missing_test_data", "low_valid_rate"}
SPEC_WARNINGS = ",".join(w.value for w in SchemathesisWarning if w.value not in SHARE_ACCEPTED_WARNINGS)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """`blockserve serve` on loopback ports, and what its two /metrics showed before any generation."""
    logs = tmp_path_factory.mktemp("first-contact")
    # A context the conformance run's requests fit in (its hooks cap their text); the README's examples fit too.
    env = loopback_env(BLOCKSERVE_MAX_MODEL_LEN="1024")
    env.pop("BLOCKSERVE_API_KEY", None)
    serve = start(["-m", "service.launch.cli", "serve"], env, logs / "serve.log")
    url = f"http://127.0.0.1:{env['BLOCKSERVE_PORT']}"
    try:
        wait_ready(url, timeout_s=180)
        fresh = {
            endpoint: httpx.get(f"http://127.0.0.1:{env[endpoint]}/metrics", timeout=5).text
            for endpoint in ("BLOCKSERVE_METRICS_PORT", "BLOCKSERVE_PORT")
        }
        yield url, fresh, logs
    finally:
        stop(serve, timeout_s=60)


def readme_block(language: str, containing: str) -> str:
    """The README's one ```language block that contains `containing`."""
    blocks = re.findall(rf"```{language}\n(.*?)```", README.read_text(), re.S)
    (block,) = [block for block in blocks if containing in block]
    assert README_ADDRESS in block, f"the README example no longer talks to {README_ADDRESS}"
    return block


def at(url: str, example: str) -> str:
    return example.replace(README_ADDRESS, url.removeprefix("http://"))


def test_the_readme_curl_example_answers_as_written(service):
    url, _, _ = service
    example = readme_block("bash", "curl ")
    result = subprocess.run(["bash", "-c", at(url, example)], capture_output=True, text=True, timeout=120)

    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert "error" not in answer, answer
    assert answer["model"] == MODEL_NAME
    assert answer["choices"][0]["message"]["content"].strip()
    assert 0 < answer["usage"]["completion_tokens"] <= 32


def test_the_readme_python_example_streams_as_written(service):
    url, _, _ = service
    example = readme_block("python", "from openai import OpenAI")
    result = subprocess.run([sys.executable, "-c", at(url, example)], capture_output=True, text=True, timeout=120)

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), "the example printed nothing"


def test_the_gguf_file_name_is_an_alias_of_the_served_model(service):
    url, _, _ = service
    assert [card["id"] for card in httpx.get(f"{url}/v1/models").json()["data"]] == [MODEL_NAME]
    body = {"model": f"{MODEL_NAME}.Q4_1", "prompt": "Hi", "max_tokens": 1}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200


def series_by_family(text: str) -> dict[str, tuple[str, list]]:
    return {family.name: (family.type, family.samples) for family in text_string_to_metric_families(text)}


@pytest.mark.parametrize("endpoint", ["BLOCKSERVE_METRICS_PORT", "BLOCKSERVE_PORT"])
def test_a_fresh_service_exports_every_series_before_any_request(service, endpoint):
    _, fresh, _ = service
    text = fresh[endpoint]
    assert shutil.which("promtool"), "promtool is missing: install Debian's prometheus package"
    checked = subprocess.run(["promtool", "check", "metrics"], input=text, text=True, capture_output=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    families = series_by_family(text)
    assert families
    empty = [name for name, (_, samples) in families.items() if not samples]
    assert not empty, f"families without a series: {empty}"
    for name, (kind, samples) in families.items():
        if kind == "histogram":
            counts = [sample for sample in samples if sample.name == f"{name}_count"]
            buckets = [sample for sample in samples if sample.name == f"{name}_bucket"]
            assert counts and buckets, name
            # Only the probes (/ready, this scrape) have been answered yet: nothing else was observed.
            not_probes = [sample for sample in counts if sample.labels.get("route", "/v1/").startswith("/v1/")]
            assert not_probes and all(sample.value == 0 for sample in not_probes), name


def test_the_schedulers_histograms_carry_the_model_name_from_the_start(service):
    _, fresh, _ = service
    families = series_by_family(fresh["BLOCKSERVE_METRICS_PORT"])
    histograms = [name for name, (kind, _) in families.items() if kind == "histogram"]
    assert "blockserve_time_to_first_token_seconds" in histograms
    assert "blockserve_step_duration_seconds" in histograms
    for name in histograms:
        assert {sample.labels.get("model_name") for sample in families[name][1]} == {MODEL_NAME}, name


def test_the_apis_route_series_exist_from_the_start(service):
    _, fresh, _ = service
    families = series_by_family(fresh["BLOCKSERVE_PORT"])
    routes = {sample.labels["route"] for sample in families["blockserve_api_http_request_duration_seconds"][1]}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= routes


def test_the_openapi_document_matches_the_server(service):
    url, _, logs = service
    env = dict(os.environ, SCHEMATHESIS_HOOKS="tests.integration.schemathesis_hooks", PYTHONPATH=str(ROOT))
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{url}/openapi.json",
        "--checks=all",  # among them: a request the document allows is accepted, one it forbids is refused
        f"--max-response-time={MAX_RESPONSE_S}",
        f"--max-time={CONFORMANCE_BUDGET_S}",
        f"--warnings={SPEC_WARNINGS}",
        "--request-timeout=60",
        "--workers=1",  # several workers trip a CPython 3.11 bug in hypothesis' lambda parsing
        "--seed=13",
        "--no-color",
        f"--report-dir={logs / 'schemathesis'}",
    ]
    result = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=CONFORMANCE_BUDGET_S + 120
    )
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    assert "No issues found" in result.stdout, result.stdout[-4000:]
