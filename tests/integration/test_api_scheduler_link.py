"""The api and its scheduler connection: aborts, readiness, lost schedulers, bad frames, metrics."""

import json
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.contract import wire
from tests.support.fake_scheduler import ApiServer, FakeScheduler, free_tcp_addr, wait_until
from tests.support.processes import loopback_env, start, stop, stop_all
from tests.support.tiny_model import MODEL_NAME

LONG_REPLY = "Once upon a time a small model served tokens to many clients, one block at a time."
COMPLETION = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 30}


@pytest.fixture
def fake():
    with FakeScheduler() as fake:
        yield fake


@pytest.fixture
def api(fake):
    with ApiServer(fake.addr) as api:
        api.wait_ready()
        yield api


def metric_value(api: ApiServer, name: str, **labels: str) -> float:
    text = httpx.get(f"{api.base_url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(key) == value for key, value in labels.items()):
                return sample.value
    raise AssertionError(f"no sample {name} {labels}")


def test_a_client_that_leaves_a_stream_aborts_its_request(fake, api):
    fake.reply_text, fake.token_delay_s = LONG_REPLY, 0.05
    with httpx.stream("POST", f"{api.base_url}/v1/completions", json={**COMPLETION, "stream": True}) as response:
        next(line for line in response.iter_lines() if line.startswith("data: {"))
    request_id = fake.generated[-1].request_id
    wait_until(lambda: request_id in fake.aborted)


def test_a_client_that_leaves_before_a_whole_response_aborts_its_request(fake, api):
    # Slow tokens: the reply must still be running when a loaded api notices the client has gone.
    fake.reply_text, fake.token_delay_s = LONG_REPLY, 0.25
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{api.base_url}/v1/completions", json=COMPLETION, timeout=0.3)
    request_id = fake.generated[-1].request_id
    wait_until(lambda: request_id in fake.aborted)


def test_ready_follows_the_schedulers_own_readiness(fake, api):
    fake.ready = False
    assert httpx.get(f"{api.base_url}/ready").status_code == 503
    fake.ready = True
    assert httpx.get(f"{api.base_url}/ready").status_code == 200


def test_the_api_starts_before_the_scheduler_and_becomes_ready_when_it_comes():
    addr = free_tcp_addr()
    with ApiServer(addr) as api:
        assert httpx.get(f"{api.base_url}/health").status_code == 200
        assert httpx.get(f"{api.base_url}/ready").status_code == 503
        assert httpx.post(f"{api.base_url}/v1/completions", json=COMPLETION).status_code == 503
        with FakeScheduler(addr):
            api.wait_ready()
            assert httpx.post(f"{api.base_url}/v1/completions", json=COMPLETION).status_code == 200


def test_ready_says_what_is_missing(tmp_path):
    """The real scheduler, which welcomes an api replica only once a worker has named the model."""
    env = loopback_env()
    with ApiServer(env["BLOCKSERVE_SCHEDULER_ADDR"]) as api:

        def reason() -> str | None:
            answer = httpx.get(f"{api.base_url}/ready", timeout=10)
            return answer.json()["reason"] if answer.status_code == 503 else None

        assert reason() == "no scheduler answers"
        processes = [start(["-m", "service.launch.cli", "scheduler"], env, tmp_path / "scheduler.log")]
        try:
            no_worker = "the scheduler answers, but no worker is registered with it"
            wait_until(lambda: reason() == no_worker, timeout_s=30)
            processes.append(start(["-m", "tests.support.fake_worker_process"], env, tmp_path / "worker.log"))
            wait_until(lambda: reason() is None, timeout_s=30)
            stop(processes[-1])
            wait_until(lambda: reason() == no_worker, timeout_s=30)
        finally:
            stop_all(processes)


def test_when_the_scheduler_is_gone_ready_fails_and_health_does_not(fake, api):
    fake.stop()
    wait_until(lambda: httpx.get(f"{api.base_url}/ready").status_code == 503)
    assert httpx.get(f"{api.base_url}/health").status_code == 200
    assert httpx.post(f"{api.base_url}/v1/completions", json=COMPLETION).status_code == 503


def test_a_stream_whose_scheduler_dies_ends_with_an_error_event(fake, api):
    fake.reply_text, fake.token_delay_s = LONG_REPLY, 0.05
    with httpx.stream("POST", f"{api.base_url}/v1/completions", json={**COMPLETION, "stream": True}) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        fake.stop()
        events = [line.removeprefix("data: ") for line in lines if line]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "server_error"


def test_a_whole_response_whose_scheduler_dies_is_a_503(fake, api):
    fake.reply_text, fake.token_delay_s = LONG_REPLY, 0.05
    threading.Timer(0.2, fake.stop).start()
    response = httpx.post(f"{api.base_url}/v1/completions", json=COMPLETION, timeout=10)
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "server_error"


def test_a_request_to_a_scheduler_that_stopped_answering_ends_with_503():
    with FakeScheduler() as fake, ApiServer(fake.addr, worker_timeout_s=0.2) as api:
        api.wait_ready()
        fake.silent = True
        response = httpx.post(f"{api.base_url}/v1/completions", json=COMPLETION, timeout=10)
    assert response.status_code == 503
    assert "stopped answering" in response.json()["error"]["message"]


def test_a_request_the_scheduler_lost_ends_with_503():
    with FakeScheduler() as fake, ApiServer(fake.addr, worker_timeout_s=0.2) as api:
        api.wait_ready()
        fake.lose_requests = True  # it answers status with no requests running or waiting
        response = httpx.post(f"{api.base_url}/v1/completions", json=COMPLETION, timeout=10)
    assert response.status_code == 503
    assert "no longer has this request" in response.json()["error"]["message"]


def test_a_request_the_scheduler_lost_ends_with_503_while_it_runs_others():
    with FakeScheduler() as fake, ApiServer(fake.addr, worker_timeout_s=0.2) as api:
        api.wait_ready()
        fake.lose_requests, fake.num_other_requests = True, 3
        response = httpx.post(f"{api.base_url}/v1/completions", json=COMPLETION, timeout=10)
    assert response.status_code == 503
    assert "no longer has this request" in response.json()["error"]["message"]


def test_a_slow_request_the_scheduler_holds_is_not_taken_as_lost():
    with FakeScheduler() as fake, ApiServer(fake.addr, worker_timeout_s=0.1) as api:
        api.wait_ready()
        fake.reply_text, fake.token_delay_s = "Hello world", 0.4  # silent for 4 idle checks per token
        response = httpx.post(f"{api.base_url}/v1/completions", json={**COMPLETION, "max_tokens": 3}, timeout=10)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3


def test_malformed_frames_are_counted_and_dropped(fake, api):
    fake.send_raw(b"\x00not msgpack")
    fake.send_raw(wire.encode(wire.Ping(version=wire.PROTOCOL_VERSION + 1)))
    fake.send_raw(wire.encode(wire.Ping()))  # valid, but not for the api
    wait_until(lambda: metric_value(api, "blockserve_api_malformed_frames_total") == 3)
    assert httpx.post(f"{api.base_url}/v1/completions", json=COMPLETION).status_code == 200


def test_metrics_count_requests_by_route_and_status_and_time_them(api):
    httpx.post(f"{api.base_url}/v1/completions", json=COMPLETION)
    httpx.post(f"{api.base_url}/v1/completions", json={**COMPLETION, "max_tokens": -1})
    httpx.get(f"{api.base_url}/no/such/path")

    labels = {"route": "/v1/completions", "method": "POST"}
    assert metric_value(api, "blockserve_api_http_requests_total", **labels, status_code="200") == 1
    assert metric_value(api, "blockserve_api_http_requests_total", **labels, status_code="400") == 1
    assert metric_value(api, "blockserve_api_http_requests_total", route="unmatched", status_code="404") == 1
    assert metric_value(api, "blockserve_api_http_request_duration_seconds_count", route="/v1/completions") == 2
    assert metric_value(api, "blockserve_api_http_requests_in_flight") == 1  # this scrape
