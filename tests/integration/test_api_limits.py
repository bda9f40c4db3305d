"""Limits at the api's edge: body size, tokenization off the event loop, text that is not Unicode, numeric ranges.

The api runs as its own process here, so a stalled event loop there cannot stall the test's clock.
"""

import concurrent.futures
import time

import httpx
import numpy as np
import pytest

from tests.support.fake_scheduler import FakeScheduler
from tests.support.processes import loopback_env, start, stop, wait_ready
from tests.support.tiny_model import MODEL_NAME

from .test_api_errors import assert_openai_error

MAX_BODY_BYTES = 8 * 1024**2
# 6.6 MB of text, within the body limit: seconds of tokenizing (half of it took 1.99 s on a 2-core EPYC).
LONG_PROMPT = "Hello world, the quick brown fox. " * 200_000
POLL_INTERVAL_S = 0.05


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    with FakeScheduler() as fake:
        env = loopback_env(
            BLOCKSERVE_SCHEDULER_ADDR=fake.addr,
            BLOCKSERVE_MAX_REQUEST_BODY_BYTES=str(MAX_BODY_BYTES),
            OMP_NUM_THREADS="1",
        )
        env.pop("BLOCKSERVE_API_KEY", None)
        api = start(["-m", "service.launch.cli", "api"], env, tmp_path_factory.mktemp("api") / "api.log")
        try:
            url = f"http://127.0.0.1:{env['BLOCKSERVE_PORT']}"
            wait_ready(url, timeout_s=30)
            yield url
        finally:
            stop(api)


@pytest.fixture
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as client:
        yield client


def health_latency_s(http: httpx.Client) -> float:
    started = time.perf_counter()
    assert http.get("/health").status_code == 200
    return time.perf_counter() - started


def health_bound_when_idle_s(http: httpx.Client) -> float:
    """A second, or ten times the median of eleven /health answers while the api is idle (a loaded machine
    is slower at both; the median, because one hiccup of a shared host made the slowest 0.25 s once and
    the bound longer than the work)."""
    return max(1.0, 10 * float(np.median([health_latency_s(http) for _ in range(11)])))


def health_latencies_while(http: httpx.Client, work) -> tuple[list[float], object, float]:
    """Poll /health while `work()` runs in a thread; the latencies, what `work` returned and how long it ran."""

    def timed_work() -> tuple[object, float]:
        started = time.perf_counter()
        return work(), time.perf_counter() - started

    latencies = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(timed_work)
        while not running.done():
            latencies.append(health_latency_s(http))
            time.sleep(POLL_INTERVAL_S)
        return latencies, *running.result()


def assert_health_answered_throughout(latencies: list[float], work_s: float, idle_bound_s: float) -> None:
    """/health answered all the while the work ran, many times and each within `idle_bound_s` or a
    quarter of the work's time (the same work is slower on a loaded machine); an event loop that the
    work stalled answers once, after it."""
    assert work_s > 2 * idle_bound_s, f"the work took {work_s:.2f} s: too short to show a stalled event loop"
    bound_s = max(idle_bound_s, work_s / 4)
    assert len(latencies) >= work_s / (POLL_INTERVAL_S + bound_s), (len(latencies), work_s)
    assert max(latencies) < bound_s, (bound_s, latencies)


def test_a_body_over_the_limit_gets_413_before_it_is_read(http):
    content = b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    error = assert_openai_error(http.post("/v1/completions", content=content), 413)
    assert str(MAX_BODY_BYTES) in error["message"]


def test_a_chunked_body_over_the_limit_gets_413_as_it_arrives(http):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 65536 + 1):
            yield b"a" * 65536
        yield b'"}'

    response = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert "content-length" not in response.request.headers  # really sent chunked
    assert_openai_error(response, 413)


def test_health_answers_throughout_the_tokenization_of_a_long_prompt(base_url, http):
    def post_long_prompt() -> httpx.Response:
        with httpx.Client(base_url=base_url, timeout=120) as other:
            return other.post("/v1/completions", json={"model": MODEL_NAME, "prompt": LONG_PROMPT})

    idle_bound_s = health_bound_when_idle_s(http)
    latencies, response, tokenize_s = health_latencies_while(http, post_long_prompt)

    error = assert_openai_error(response, 400)  # tokenized in full, then found too long for the context
    assert "maximum context length" in error["message"]
    assert_health_answered_throughout(latencies, tokenize_s, idle_bound_s)


def test_health_answers_while_an_oversized_body_is_refused(base_url, http):
    """The body comes slowly and without a Content-Length, so the api reads it as it arrives until it
    is over the limit (a declared length over it is refused at once, with nothing to poll during)."""
    idle_bound_s = health_bound_when_idle_s(http)
    chunk = b"a" * 65536
    num_chunks = MAX_BODY_BYTES // len(chunk) + 1
    pause_s = 3 * idle_bound_s / num_chunks

    def slow_chunks():
        yield b'{"prompt": "'
        for _ in range(num_chunks):
            time.sleep(pause_s)
            yield chunk
        yield b'"}'

    def post_slowly() -> httpx.Response:
        with httpx.Client(base_url=base_url, timeout=120) as other:
            return other.post("/v1/completions", content=slow_chunks(), headers={"Content-Type": "application/json"})

    latencies, response, upload_s = health_latencies_while(http, post_slowly)

    assert_openai_error(response, 413)
    assert_health_answered_throughout(latencies, upload_s, idle_bound_s)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"prompt": "\\ud800"}', "prompt"),
        (b'{"prompt": ["fine", "a\\udfffb"]}', "prompt.1"),
        (b'{"prompt": "hi", "stop": ["\\ud83d"]}', "stop.0"),
        (b'{"prompt": "hi", "model": "\\udc00"}', "model"),
    ],
)
def test_text_that_is_not_valid_unicode_gets_400_naming_where(http, body, param):
    response = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    error = assert_openai_error(response, 400, param)
    assert "not valid Unicode" in error["message"]


def test_a_chat_message_that_is_not_valid_unicode_gets_400(http):
    body = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "x\\ud800"}]}'
    response = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert_openai_error(response, 400, "messages.1.content")


# OpenAI's ranges, and vLLM's for the parameters OpenAI does not have.
OUT_OF_RANGE = {
    "temperature": [-0.1, 2.01, 1e308],
    "top_p": [0.0, -0.5, 1.01],
    "top_k": [-2, 2**31],
    "min_p": [-0.01, 1.01],
    "presence_penalty": [-2.01, 2.01],
    "frequency_penalty": [-2.01, 2.01],
    "repetition_penalty": [0.0, -1.0, 2.01],
    "max_tokens": [0, -1],
    "n": [0, 129],
    "seed": [-1, 2**53, 2**63],
    "logprobs": [-1, 21],
}


@pytest.mark.parametrize(
    ("param", "value"), [(param, value) for param, values in OUT_OF_RANGE.items() for value in values]
)
def test_every_numeric_sampling_parameter_out_of_range_gets_400(http, param, value):
    response = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", param: value})
    assert_openai_error(response, 400, param)


@pytest.mark.parametrize("param", ["temperature", "top_p", "min_p", "presence_penalty", "repetition_penalty"])
@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinities_get_400(http, param, value):
    content = b'{"prompt": "hi", "' + param.encode() + b'": ' + value + b"}"
    response = http.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert_openai_error(response, 400, param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": -1, "logprobs": True}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"temperature": 3}, "temperature"),
    ],
)
def test_chat_numeric_parameters_out_of_range_get_400(http, body, param):
    messages = [{"role": "user", "content": "hi"}]
    response = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages, **body})
    assert_openai_error(response, 400, param)


def test_values_at_the_edges_of_the_ranges_are_accepted(http):
    edges = {"temperature": 2.0, "top_p": 1.0, "top_k": -1, "min_p": 1.0, "presence_penalty": -2.0}
    edges |= {"frequency_penalty": 2.0, "repetition_penalty": 2.0, "seed": 0, "logprobs": 20, "n": 2}
    response = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, **edges})
    assert response.status_code == 200, response.text
