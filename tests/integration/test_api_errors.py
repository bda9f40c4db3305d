"""Whatever a client sends, the answer is an OpenAI-shaped error and the service keeps serving."""

import json

import httpx
import pytest

from tests.support.fake_scheduler import ApiServer, FakeScheduler
from tests.support.tiny_model import MAX_MODEL_LEN, MODEL_NAME

CHAT = [{"role": "user", "content": "Say hello"}]


@pytest.fixture
def fake(stack):
    fake, _ = stack
    fake.error, fake.error_after_tokens = None, 0
    return fake


@pytest.fixture
def http(stack):
    _, api = stack
    with httpx.Client(base_url=api.base_url, timeout=10) as client:
        yield client


def assert_openai_error(response: httpx.Response, status_code: int, param: str | None = None) -> dict:
    assert response.status_code == status_code, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["type"] == ("invalid_request_error" if status_code < 500 else "server_error")
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
        ({"prompt": "hi", "temperature": 2.5}, "temperature"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "top_p": 1.5}, "top_p"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "logprobs": 99}, "logprobs"),
        ({"prompt": "hi", "stream": "yes"}, "stream"),
        ({"prompt": "hi", "stop": ""}, None),
        ({"prompt": "hi", "seed": -1}, "seed"),
        ({"prompt": "hi", "top_k": 10**30}, "top_k"),
        ({"prompt": 123}, None),
        ({"prompt": [1, "two"]}, None),
        ({"prompt": []}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": "hi", "stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"prompt": "hi", "logit_bias": {"1000000": 1}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"5": 100.5}}, "logit_bias.5"),
        ({"prompt": "hi", "logit_bias": {"5": -101}}, "logit_bias.5"),
        ({"prompt": "hi", "logit_bias": {"five": 1}}, "logit_bias.five.[key]"),
        ({"prompt": "hi", "logit_bias": {"5": "1"}}, "logit_bias.5"),
        ({"prompt": "hi", "logit_bias": [5]}, "logit_bias"),
        ({}, "prompt"),
    ],
)
def test_invalid_completion_requests_get_400(http, body, param):
    assert_openai_error(http.post("/v1/completions", json={"model": MODEL_NAME, **body}), 400, param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, None),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None),
        ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": CHAT, "logit_bias": {"1000000": 1}}, "logit_bias"),
        ({"messages": CHAT, "max_completion_tokens": -3}, "max_completion_tokens"),
    ],
)
def test_invalid_chat_requests_get_400(http, body, param):
    assert_openai_error(http.post("/v1/chat/completions", json={"model": MODEL_NAME, **body}), 400, param)


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"", b'"just a string"', b"\xff\xfe"])
def test_a_body_that_is_not_a_json_object_gets_400(http, content):
    response = http.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert_openai_error(response, 400)


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_finite_numbers_get_400(http, value):
    content = b'{"prompt": "hi", "temperature": ' + value + b"}"
    response = http.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert_openai_error(response, 400, "temperature")


def test_an_unknown_model_gets_404_model_not_found(http):
    error = assert_openai_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404, "model")
    assert error["code"] == "model_not_found"


def test_a_prompt_and_max_tokens_over_the_context_get_400_naming_the_limit(http):
    response = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [5] * 100, "max_tokens": 50})
    error = assert_openai_error(response, 400)
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    assert "150" in error["message"]


def test_a_chat_longer_than_the_context_gets_400(http):
    messages = [{"role": "user", "content": "Hello world " * 200}]
    response = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages})
    error = assert_openai_error(response, 400)
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]


def test_an_unknown_route_gets_an_openai_shaped_404(http):
    assert_openai_error(http.get("/v1/engines"), 404)


def test_a_scheduler_error_before_any_token_becomes_that_http_status(fake, http):
    fake.error = (400, "this prompt can never fit in the KV cache")
    error = assert_openai_error(http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"}), 400)
    assert error["message"] == "this prompt can never fit in the KV cache"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_scheduler_error_before_the_first_token_of_a_stream_becomes_that_http_status(fake, http, path):
    fake.error = (503, "no worker is available")
    body = {"model": MODEL_NAME, "prompt": "hi", "messages": CHAT, "stream": True}
    error = assert_openai_error(http.post(path, json=body), 503)
    assert error["message"] == "no worker is available"


def test_a_scheduler_error_in_a_stream_after_its_first_token_is_an_error_event_then_done(fake, http):
    fake.error, fake.error_after_tokens = (500, "the worker crashed"), 2
    response = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": CHAT, "stream": True})
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line]

    assert response.status_code == 200
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(event)["choices"][0]["delta"].get("content", "") for event in events[:-2])
    assert text and "Hello world".startswith(text)  # the tokens before the error came through
    error = json.loads(events[-2])["error"]
    assert error["message"] == "the worker crashed"
    assert error["type"] == "server_error"


def test_the_service_keeps_serving_after_bad_requests(fake, http):
    for content in (b"{", b"null", b'{"prompt": {"deep": [[[]]]}}'):
        http.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
    response = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"})
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == "Hello world"


def test_without_the_api_key_v1_routes_get_401_but_probes_stay_open():
    with FakeScheduler() as fake, ApiServer(fake.addr, api_key="sekrit") as api:
        api.wait_ready()
        with httpx.Client(base_url=api.base_url, timeout=10) as http:
            body = {"model": MODEL_NAME, "prompt": "hi"}
            error = assert_openai_error(http.post("/v1/completions", json=body), 401)
            assert error["code"] == "invalid_api_key"
            assert_openai_error(http.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"}), 401)
            assert_openai_error(http.post("/v1/completions", content=b"{", headers={"Authorization": "x"}), 401)
            assert_openai_error(http.post("/v1/completions", json=body, headers={"Authorization": "Basic sekrit"}), 401)
            for header in ("Bearer sekrit", "bearer sekrit", "BEARER  sekrit"):  # the scheme is case-insensitive
                authorized = http.post("/v1/completions", json=body, headers={"Authorization": header})
                assert authorized.status_code == 200, header
            assert [http.get(path).status_code for path in ("/health", "/ready", "/metrics")] == [200, 200, 200]
