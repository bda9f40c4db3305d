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

from tests.support.processes import loopback_env, scrape, start, stop, stop_all, wait_ready

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
    # float32, unquantized: these tests hold the service to transformers' float32 numbers (other precisions:
    # test_worker_accuracy.py).
    env = loopback_env(
        BLOCKSERVE_NUM_KV_BLOCKS=str(NUM_KV_BLOCKS),
        BLOCKSERVE_MAX_NUM_SEQS="32",
        BLOCKSERVE_DTYPE="float32",
        BLOCKSERVE_QUANTIZATION="none",
        **overrides,
    )
    second_api = dict(env, BLOCKSERVE_PORT=str(int(env["BLOCKSERVE_PORT"]) + 1))
    processes = [
        start(["-m", "service.launch.cli", "scheduler"], env, logs / "scheduler.log"),
        start(["-m", "service.launch.cli", "worker"], env, logs / "worker.log"),
        start(["-m", "service.launch.cli", "api"], env, logs / "api1.log"),
        start(["-m", "service.launch.cli", "api"], second_api, logs / "api2.log"),
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
def reference_model(hf_smollm_tokenizer, hf_smollm_model):
    """transformers on torch fp32, loading the same GGUF file: (tokenizer, model)."""
    return hf_smollm_tokenizer, hf_smollm_model


@pytest.fixture(scope="module")
def reference_greedy(reference_model):
    """The reference model's greedy continuation: prompt -> text (to EOS)."""
    import torch

    tokenizer, model = reference_model

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


def test_logit_bias_steers_greedy_sampling(stack, hf_smollm_tokenizer):
    _, urls = stack
    client, model = client_for(urls[0]), model_name(urls[0])
    greedy = dict(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
    plain = client.completions.create(**greedy, extra_body={"ignore_eos": True}).choices[0].text
    (blue,) = hf_smollm_tokenizer.encode(" blue", add_special_tokens=False)
    forced = client.completions.create(**greedy, logit_bias={str(blue): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == " blue" * 4, (plain, forced.choices[0].text)
    first = hf_smollm_tokenizer.encode(plain, add_special_tokens=False)[0]
    banned = client.completions.create(**greedy, logit_bias={str(first): -100}, extra_body={"ignore_eos": True})
    assert hf_smollm_tokenizer.encode(banned.choices[0].text, add_special_tokens=False)[0] != first, (plain, banned)
    assert banned.choices[0].text != plain


def test_greedy_output_over_http_equals_transformers(stack, reference_greedy):
    _, urls = stack
    generate = reference_greedy
    client = client_for(urls[0])
    model = model_name(urls[0])
    for prompt in PROMPTS[:4]:
        completion = client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0)
        assert completion.choices[0].text == generate(prompt, 32), prompt


# Our fp32 kernels (custom or Paddle) against torch's: logprobs at most 3.2e-4 apart (8 prompts x 16 tokens x top 20).
LOGPROB_ATOL = 1e-3
NUM_TOP_LOGPROBS = 5
NUM_LOGPROB_TOKENS = 6


def reference_continuation(reference_model, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], list]:
    """The reference model's greedy tokens after `prompt_ids` (EOS is no stop), and its fp64 log-softmax at each."""
    import torch

    _, model = reference_model
    token_ids, rows = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        while True:
            rows.append(torch.log_softmax(out.logits[0, -1].double(), dim=-1))
            token_ids.append(int(rows[-1].argmax()))
            if len(token_ids) == num_tokens:
                return token_ids, rows
            out = model(torch.tensor([token_ids[-1:]]), past_key_values=out.past_key_values, use_cache=True)


def token_text(tokenizer, token_id: int) -> str:
    """How one token reads on its own, special tokens included (as logprobs name it)."""
    return tokenizer.decode([token_id], clean_up_tokenization_spaces=False)


def assert_top_logprobs_match(top: list[tuple[str, float]], row, tokenizer, where: str) -> None:
    """`top` is the reference's k most likely tokens with their logprobs, most likely first. Within the
    tolerance, tokens about as likely as the k-th may stand in for it."""
    k = NUM_TOP_LOGPROBS
    values, ids = row.topk(2 * k)
    reference = [(token_text(tokenizer, token_id), value) for token_id, value in zip(ids.tolist(), values.tolist())]
    logprobs = [logprob for _, logprob in top]
    assert logprobs == sorted(logprobs, reverse=True), where
    for text, logprob in top:
        assert logprob >= reference[k - 1][1] - LOGPROB_ATOL, (where, text, logprob, reference)
        assert any(t == text and abs(v - logprob) <= LOGPROB_ATOL for t, v in reference), (where, text, logprob)
    if reference[k - 1][1] - reference[k][1] > LOGPROB_ATOL:
        assert {text for text, _ in top} == {text for text, _ in reference[:k]}, (where, top, reference)


def test_completion_logprobs_and_top_logprobs_equal_transformers_log_softmax(stack, reference_model):
    _, urls = stack
    tokenizer, _ = reference_model
    prompts = PROMPTS[:2]
    completion = client_for(urls[0]).completions.create(
        model=model_name(urls[0]),
        prompt=prompts,
        max_tokens=NUM_LOGPROB_TOKENS,
        temperature=0,
        logprobs=NUM_TOP_LOGPROBS,
        extra_body={"ignore_eos": True},
    )
    prompt_ids = [tokenizer(prompt).input_ids for prompt in prompts]
    assert completion.usage.prompt_tokens == sum(map(len, prompt_ids))  # the same tokens go in
    assert [choice.index for choice in completion.choices] == list(range(len(prompts)))
    for choice in completion.choices:
        token_ids, rows = reference_continuation(reference_model, prompt_ids[choice.index], NUM_LOGPROB_TOKENS)
        logprobs = choice.logprobs
        assert logprobs.tokens == [token_text(tokenizer, token_id) for token_id in token_ids], choice.index
        for position, (token_id, row) in enumerate(zip(token_ids, rows)):
            where = f"prompt {choice.index}, token {position}"
            assert abs(logprobs.token_logprobs[position] - float(row[token_id])) <= LOGPROB_ATOL, where
            assert_top_logprobs_match(list(logprobs.top_logprobs[position].items()), row, tokenizer, where)


def test_chat_logprobs_and_top_logprobs_equal_transformers_log_softmax(stack, reference_model):
    _, urls = stack
    tokenizer, _ = reference_model
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client_for(urls[0]).chat.completions.create(
        model=model_name(urls[0]),
        messages=messages,
        max_tokens=NUM_LOGPROB_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=NUM_TOP_LOGPROBS,
        extra_body={"ignore_eos": True},
    )
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(rendered, add_special_tokens=False).input_ids
    assert chat.usage.prompt_tokens == len(prompt_ids)  # the same tokens go in
    token_ids, rows = reference_continuation(reference_model, prompt_ids, NUM_LOGPROB_TOKENS)
    content = chat.choices[0].logprobs.content
    assert [entry.token for entry in content] == [token_text(tokenizer, token_id) for token_id in token_ids]
    exact_text = tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert b"".join(bytes(entry.bytes) for entry in content) == exact_text.encode()
    for position, (entry, token_id, row) in enumerate(zip(content, token_ids, rows)):
        where = f"token {position}"
        assert abs(entry.logprob - float(row[token_id])) <= LOGPROB_ATOL, where
        assert len(entry.top_logprobs) == NUM_TOP_LOGPROBS, where
        assert_top_logprobs_match([(alt.token, alt.logprob) for alt in entry.top_logprobs], row, tokenizer, where)


def stop_string_across_a_token_boundary(tokenizer, token_ids: list[int]) -> tuple[str, int]:
    """A stop string made of the end of one token and the start of the next, first seen at that boundary
    (so it completes with the second token); and the number of tokens up to that second token."""

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    text = decode(token_ids)
    prefixes = [decode(token_ids[:length]) for length in range(len(token_ids) + 1)]
    # Halfway or later first: several chunks stream before the stop string begins.
    halfway = max(1, len(token_ids) // 2)
    boundaries = [*range(halfway, len(token_ids)), *range(1, halfway)]  # each: the index of the second token
    for tail, head in ((2, 2), (2, 1), (1, 2), (1, 1)):  # characters from the first token, from the second
        for second in boundaries:
            before, boundary, after = prefixes[second - 1 : second + 2]
            if not (text.startswith(boundary) and text.startswith(after)):
                continue  # a boundary inside a character
            start, end = len(boundary) - tail, len(boundary) + head
            if 0 < start and len(before) <= start and end <= len(after) and text.find(text[start:end]) == start:
                return text[start:end], second + 1
    raise AssertionError(f"no token boundary of {text!r} makes a stop string: choose another prompt")


@pytest.fixture(scope="module")
def split_stop(reference_model) -> tuple[dict, str, int]:
    """(a greedy request with a stop string that spans two tokens of its output, the text before the stop
    string, the number of tokens up to the one that completes it), from the reference's continuation."""
    tokenizer, _ = reference_model
    prompt, max_tokens = PROMPTS[2], 12
    token_ids, _ = reference_continuation(reference_model, tokenizer(prompt).input_ids, max_tokens)
    if tokenizer.eos_token_id in token_ids:
        token_ids = token_ids[: token_ids.index(tokenizer.eos_token_id)]
    stop, num_tokens = stop_string_across_a_token_boundary(tokenizer, token_ids)
    text = tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    request = dict(prompt=prompt, max_tokens=max_tokens, temperature=0, stop=[stop])
    return request, text[: text.find(stop)], num_tokens


def test_stop_string_split_across_two_tokens_ends_the_output_just_before_it(either_stack, split_stop):
    """Streamed or not: the text before the stop string, finish_reason "stop", and no character of the stop
    string or after it in any chunk (the start of a stop string is held back until it is known)."""
    _, urls = either_stack
    body, before_stop, num_tokens = split_stop
    client = client_for(urls[0])
    request = dict(body, model=model_name(urls[0]))

    completion = client.completions.create(**request)
    chunks = list(client.completions.create(**request, stream=True, stream_options={"include_usage": True}))

    choice = completion.choices[0]
    assert (choice.text, choice.finish_reason) == (before_stop, "stop"), body["stop"]
    assert completion.usage.completion_tokens == num_tokens  # nothing counted past the token that completed it
    pieces = [(chunk.choices[0].text, chunk.choices[0].finish_reason) for chunk in chunks if chunk.choices]
    assert "".join(text for text, _ in pieces) == before_stop, (body["stop"], pieces)
    assert [reason for _, reason in pieces] == [None] * (len(pieces) - 1) + ["stop"], pieces
    assert chunks[-1].usage.completion_tokens == num_tokens


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
    """A stream on each replica: both had tokens before either ended (in flight at one moment, in the same steps),
    and each got the text its prompt gets alone (asked of the other replica)."""
    _, urls = stack
    asks = dict(max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    events: list[tuple[str, int]] = []  # ("token" or "end", replica), in the order the streams saw them

    async def stream(replica: int, prompt: str) -> str:
        client = openai.AsyncOpenAI(base_url=f"{urls[replica]}/v1", api_key="unused", max_retries=0, timeout=120)
        chunks = await client.completions.create(model=model_name(urls[replica]), prompt=prompt, stream=True, **asks)
        text = ""
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].text:
                events.append(("token", replica))
                text += chunk.choices[0].text
        events.append(("end", replica))
        return text

    async def both() -> list[str]:
        return await asyncio.gather(stream(0, PROMPTS[0]), stream(1, PROMPTS[1]))

    texts = asyncio.run(both())
    first_end = events.index(next(event for event in events if event[0] == "end"))
    assert {replica for kind, replica in events[:first_end] if kind == "token"} == {0, 1}, events
    for replica, prompt, text in zip((0, 1), PROMPTS, texts):
        other = urls[1 - replica]
        alone = client_for(other).completions.create(model=model_name(other), prompt=prompt, **asks)
        assert text and text == alone.choices[0].text


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
    ok = client_for(urls[0]).completions.create(
        model=model_name(urls[0]), prompt="Hi", max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert ok.usage.completion_tokens == 2 and ok.choices[0].finish_reason == "length"  # still generating


def test_killed_worker_ends_in_flight_requests_with_an_error_and_not_ready(tmp_path):
    env = loopback_env()
    scheduler = start(["-m", "service.launch.cli", "scheduler"], env, tmp_path / "scheduler.log")
    worker = start(["-m", "service.launch.cli", "worker"], env, tmp_path / "worker.log")
    api = start(["-m", "service.launch.cli", "api"], env, tmp_path / "api.log")
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
    serve = start(["-m", "service.launch.cli", "serve"], env, log_path)
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
    completion = client_for(url).completions.create(
        model=model_name(url), prompt=PROMPTS[0], max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert completion.usage.completion_tokens == 4  # sampled: without ignore_eos an early stop would be fair


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
