"""The whole service on the real model: scheduler, worker and two api replicas as processes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.processes import loopback_env, scrape, start, stop, stop_all, wait_ready

# 16 blocks of 16 tokens: about 8 requests of a short prompt and 24 output tokens at once.
NUM_KV_BLOCKS = 16
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colours are",
    "Water boils at a temperature of",
    "A haiku about the sea:",
    "The quick brown fox",
    "import numpy as np\n",
]


def start_stack(logs, **overrides: str):
    """scheduler + worker + two api replicas on one tight KV cache; yields (env, urls)."""
    env = loopback_env(BLOCKSERVE_NUM_KV_BLOCKS=str(NUM_KV_BLOCKS), BLOCKSERVE_MAX_NUM_SEQS="32", **overrides)
    second_api = dict(env, BLOCKSERVE_PORT=str(int(env["BLOCKSERVE_PORT"]) + 1))
    processes = [
        start(["-m", "service.cli", "scheduler"], env, logs / "scheduler.log"),
        start(["-m", "service.cli", "worker"], env, logs / "worker.log"),
        start(["-m", "service.cli", "api"], env, logs / "api1.log"),
        start(["-m", "service.cli", "api"], second_api, logs / "api2.log"),
    ]
    urls = [f"http://127.0.0.1:{e['BLOCKSERVE_PORT']}" for e in (env, second_api)]
    try:
        for url in urls:
            wait_ready(url, timeout_s=180)
        yield env, urls
    finally:
        stop_all(processes)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The stack with the default (overlapped) step loop."""
    yield from start_stack(tmp_path_factory.mktemp("stack"))


@pytest.fixture(scope="module")
def serial_stack(tmp_path_factory):
    """The same stack with the serial step loop (BLOCKSERVE_ASYNC_SCHEDULING=0), the baseline."""
    yield from start_stack(tmp_path_factory.mktemp("serial_stack"), BLOCKSERVE_ASYNC_SCHEDULING="0")


@pytest.fixture(params=["overlapped", "serial"])
def either_stack(request):
    """The overlapped and the serial stack in turn."""
    return request.getfixturevalue("stack" if request.param == "overlapped" else "serial_stack")


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def model_name(url: str) -> str:
    return client_for(url).models.list().data[0].id


@pytest.fixture(scope="module")
def reference_greedy():
    """transformers on torch fp32, loading the same GGUF file: prompt -> greedy continuation text (to EOS)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from service.config import default_model_path

    path = default_model_path()
    folder, name = path.rsplit("/", 1)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32).eval()

    def generate(prompt: str, max_tokens: int) -> str:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=0
            )
        return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    return generate


def test_openai_client_chat_and_completion_streamed_and_not(stack):
    _, urls = stack
    client = client_for(urls[0])
    model = model_name(urls[0])
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12
    )
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 12
    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert completion.choices[0].text and completion.usage.completion_tokens <= 8
    pieces = [
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Count to five."}], max_tokens=16, stream=True
        )
        if chunk.choices
    ]
    assert "".join(pieces)
    streamed = "".join(
        chunk.choices[0].text
        for chunk in client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
        )
    )
    assert streamed == completion.choices[0].text


def test_greedy_output_over_http_equals_transformers(stack, reference_greedy):
    _, urls = stack
    generate = reference_greedy
    client = client_for(urls[0])
    model = model_name(urls[0])
    for prompt in PROMPTS[:4]:
        completion = client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0)
        assert completion.choices[0].text == generate(prompt, 32), prompt


def test_greedy_outputs_are_token_identical_with_the_overlapped_and_the_serial_loop(stack, serial_stack):
    async def texts(urls: list[str]) -> list[tuple[str, list[str]]]:
        async def one(index: int) -> tuple[str, list[str]]:
            client = openai.AsyncOpenAI(base_url=f"{urls[0]}/v1", api_key="unused", max_retries=0, timeout=120)
            completion = await client.completions.create(
                model=model_name(urls[0]),
                prompt=PROMPTS[index],
                max_tokens=12 + 4 * index,  # requests end at different steps, while others still decode
                temperature=0,
                logprobs=1,
            )
            choice = completion.choices[0]
            return choice.text, choice.logprobs.tokens

        return await asyncio.gather(*(one(i) for i in range(6)))

    overlapped, serial = asyncio.run(texts(stack[1])), asyncio.run(texts(serial_stack[1]))
    assert overlapped == serial
    assert all(tokens for _, tokens in overlapped)


def test_two_api_replicas_serve_at_once(stack):
    _, urls = stack

    async def one(url: str, prompt: str) -> str:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        completion = await client.completions.create(model=model_name(url), prompt=prompt, max_tokens=8, temperature=0)
        return completion.choices[0].text

    async def both() -> list[str]:
        return await asyncio.gather(*(one(urls[i % 2], PROMPTS[i]) for i in range(6)))

    texts = asyncio.run(both())
    assert all(texts)
    alone = client_for(urls[1]).completions.create(
        model=model_name(urls[1]), prompt=PROMPTS[0], max_tokens=8, temperature=0
    )
    assert texts[0] == alone.choices[0].text


def test_64_concurrent_streams_on_a_cache_for_8_all_finish_with_preemptions(either_stack):
    env, urls = either_stack
    metrics_port = env["BLOCKSERVE_METRICS_PORT"]
    before = scrape(metrics_port)
    max_tokens = 24

    async def stream(index: int) -> int:
        client = openai.AsyncOpenAI(base_url=f"{urls[index % 2]}/v1", api_key="unused", max_retries=0, timeout=300)
        chunks = await client.completions.create(
            model=model_name(urls[0]),
            prompt=PROMPTS[index % len(PROMPTS)],
            max_tokens=max_tokens,
            temperature=0.8,
            seed=index,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = None
        async for chunk in chunks:
            usage = chunk.usage or usage
        return usage.completion_tokens

    async def all_streams() -> list[int]:
        return await asyncio.gather(*(stream(i) for i in range(64)))

    assert asyncio.run(all_streams()) == [max_tokens] * 64
    after = scrape(metrics_port)
    assert after["blockserve_num_preemptions_total"] > before["blockserve_num_preemptions_total"]
    assert after["blockserve_generation_tokens_total"] - before["blockserve_generation_tokens_total"] == 64 * max_tokens
    assert after["blockserve_kv_blocks_free"] == after["blockserve_kv_blocks_capacity"] == NUM_KV_BLOCKS
    assert after["blockserve_kv_cache_usage_ratio"] == 0.0


def test_client_disconnect_aborts_the_request_and_frees_its_blocks(either_stack):
    env, urls = either_stack
    metrics_port = env["BLOCKSERVE_METRICS_PORT"]
    aborted_before = scrape_reason(metrics_port, "abort")
    body = {"model": model_name(urls[0]), "prompt": PROMPTS[2], "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{urls[0]}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
    deadline = time.monotonic() + 10
    while scrape_reason(metrics_port, "abort") == aborted_before:
        assert time.monotonic() < deadline, "the disconnected request was not aborted"
        time.sleep(0.1)
    # Overlapped, the aborted request's blocks come back when the step still computing it returns.
    while (samples := scrape(metrics_port))["blockserve_kv_blocks_free"] != samples["blockserve_kv_blocks_capacity"]:
        assert time.monotonic() < deadline, f"{samples['blockserve_kv_blocks_free']} blocks free after the abort"
        time.sleep(0.05)


def scrape_reason(port: str, reason: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "blockserve_requests_finished_total" and sample.labels.get("reason") == reason:
                return sample.value
    return 0.0


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ({"prompt": "hi", "temperature": 9}, 400, "temperature"),
        ({"prompt": "word " * 9000, "max_tokens": 4}, 400, "maximum context length"),
        ({"prompt": "hi", "model": "no-such-model"}, 404, "no-such-model"),
    ],
)
def test_bad_requests_get_4xx_and_the_service_keeps_serving(stack, body, status, fragment):
    _, urls = stack
    payload = {"model": model_name(urls[0]), **body}
    response = httpx.post(f"{urls[0]}/v1/completions", json=payload, timeout=30)
    assert response.status_code == status
    assert fragment in response.json()["error"]["message"]
    response = httpx.post(
        f"{urls[0]}/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}, timeout=30
    )
    assert response.status_code == 400 and "error" in response.json()
    ok = client_for(urls[0]).completions.create(model=model_name(urls[0]), prompt="Hi", max_tokens=2)
    assert ok.choices[0].text is not None


def test_killed_worker_ends_in_flight_requests_with_an_error_and_not_ready(tmp_path):
    env = loopback_env()
    scheduler = start(["-m", "service.cli", "scheduler"], env, tmp_path / "scheduler.log")
    worker = start(["-m", "service.cli", "worker"], env, tmp_path / "worker.log")
    api = start(["-m", "service.cli", "api"], env, tmp_path / "api.log")
    url = f"http://127.0.0.1:{env['BLOCKSERVE_PORT']}"
    try:
        wait_ready(url, timeout_s=180)
        model = model_name(url)

        async def stream(index: int):
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            received = 0
            try:
                chunks = await client.completions.create(
                    model=model, prompt=PROMPTS[index], max_tokens=500, stream=True, extra_body={"ignore_eos": True}
                )
                async for _ in chunks:
                    received += 1
                    if received == 3 and index == 0:
                        worker.send_signal(signal.SIGKILL)
            except openai.APIError as exc:
                return received, exc
            return received, None

        async def streams():
            return await asyncio.gather(*(stream(i) for i in range(4)))

        started = time.monotonic()
        results = asyncio.run(streams())
        assert time.monotonic() - started < 60
        assert all(received < 500 and isinstance(error, openai.APIError) for received, error in results)
        assert httpx.get(f"{url}/ready", timeout=5).status_code == 503
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    finally:
        stop_all([api, worker, scheduler])


SERVE_DRAIN_S = 8


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`blockserve serve` as one process with a short drain: (process, url, its log file)."""
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    env = loopback_env(BLOCKSERVE_DRAIN_TIMEOUT_S=str(SERVE_DRAIN_S))
    serve = start(["-m", "service.cli", "serve"], env, log_path)
    url = f"http://127.0.0.1:{env['BLOCKSERVE_PORT']}"
    try:
        wait_ready(url, timeout_s=180)
        yield serve, url, log_path
    finally:
        stop(serve, timeout_s=SERVE_DRAIN_S + 10)


def child_pid(log_path, role: str) -> int:
    """The pid of the last `role` process that serve started, from its log."""
    pids = re.findall(rf"(?:started|restarted) the {role} process \(pid (\d+)\)", log_path.read_text())
    assert pids, f"serve did not log a {role} start"
    return int(pids[-1])


def test_serve_restarts_a_killed_role_and_serves_again(served):
    serve, url, log_path = served
    scheduler_pid, worker_pid = child_pid(log_path, "scheduler"), child_pid(log_path, "worker")

    os.kill(scheduler_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/ready", timeout=5).status_code == 200:
        assert time.monotonic() < deadline, "the api stayed ready with its scheduler killed"
        time.sleep(0.1)
    wait_ready(url, timeout_s=30)

    log = log_path.read_text()
    assert f"the scheduler process (pid {scheduler_pid}) exited with code -9; restarting it" in log
    assert child_pid(log_path, "scheduler") != scheduler_pid
    assert child_pid(log_path, "worker") == worker_pid and serve.poll() is None  # the others kept running
    completion = client_for(url).completions.create(model=model_name(url), prompt=PROMPTS[0], max_tokens=4)
    assert completion.usage.completion_tokens == 4


def test_sigterm_to_serve_drains_streams_and_ends_the_rest_with_an_error_and_done(served):
    serve, url, log_path = served
    model = model_name(url)
    max_tokens = [12, 12, 12, 4000, 4000, 4000]  # the long ones cannot finish within the drain
    streams: list[list[str]] = [[] for _ in max_tokens]
    started = threading.Barrier(len(max_tokens) + 1, timeout=60)

    def stream(index: int) -> None:
        body = {"model": model, "prompt": PROMPTS[index], "max_tokens": max_tokens[index], "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "ignore_eos": True}, timeout=60) as response:
            for line in response.iter_lines():
                if line:
                    streams[index].append(line)
                    if len(streams[index]) == 1:
                        started.wait()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(max_tokens))]
    for thread in threads:
        thread.start()
    started.wait()
    serve.send_signal(signal.SIGTERM)
    terminated_at = time.monotonic()
    for thread in threads:
        thread.join(SERVE_DRAIN_S + 10)
    assert serve.wait(SERVE_DRAIN_S + 10) == 0
    stopped_after_s = time.monotonic() - terminated_at

    for lines, limit in zip(streams, max_tokens):
        assert lines[-1] == "data: [DONE]", lines[-3:]  # not a cut connection
        events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        errors = [event["error"] for event in events if "error" in event]
        finish_reasons = [event["choices"][0]["finish_reason"] for event in events if event.get("choices")]
        if limit == 12:  # drained: every token came
            assert errors == [] and finish_reasons[-1] == "length", lines[-3:]
        else:
            assert len(errors) == 1 and "shutting down" in errors[0]["message"], lines[-3:]
    assert stopped_after_s <= SERVE_DRAIN_S + 5
    assert "Traceback" not in log_path.read_text()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=2)
