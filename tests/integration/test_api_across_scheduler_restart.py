"""An api replica across a scheduler that dies and comes back on the same address serving another model.

First the real stack (scheduler, SmolLM2 worker, api as separate processes); then the scheduler and its
worker are killed, and a new scheduler on the same api address gets a model-free worker that serves
"tiny-test-model" (its own tokenizer, name and context length). The api must end what was in flight with
an error, refuse what comes while no scheduler is there, and serve what comes after the new welcome with
the new model's tokenizer and limits. Every client call has a timeout: nothing may hang.
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import openai

from tests.support.processes import free_port, loopback_env, scrape, start, stop_all, wait_ready
from tests.support.tiny_model import tiny_model_info, tiny_tokenizer

CLIENT_TIMEOUT_S = 60
ERROR_WITHIN_S = 10  # a lost connection ends open requests at once, not after the idle check (30 s)
SHORT_PROMPT = "The capital of France is"


def kill(process) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(10)


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


async def requests_in_flight_when(kill_scheduler, url: str, model: str) -> list[BaseException | None]:
    """One whole and one streamed completion, both running when `kill_scheduler` is called; how each ended."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)
    body = dict(model=model, prompt=SHORT_PROMPT, max_tokens=500, extra_body={"ignore_eos": True})
    streaming = asyncio.Event()

    async def whole() -> None:
        await client.completions.create(**body)

    async def streamed() -> None:
        async for _ in await client.completions.create(**body, stream=True):
            streaming.set()

    async def killer() -> None:
        await asyncio.wait_for(streaming.wait(), CLIENT_TIMEOUT_S)
        await asyncio.to_thread(kill_scheduler)

    outcomes = await asyncio.gather(whole(), streamed(), killer(), return_exceptions=True)
    assert outcomes[2] is None, outcomes[2]
    return outcomes[:2]


def test_api_ends_in_flight_requests_and_then_serves_the_model_of_a_new_scheduler_on_its_address(tmp_path):
    env = loopback_env()
    # The second scheduler keeps the api's address; its worker gets an address of its own.
    second_env = dict(
        env, BLOCKSERVE_WORKER_ADDR=f"tcp://127.0.0.1:{free_port()}", BLOCKSERVE_METRICS_PORT=str(free_port())
    )
    url = f"http://127.0.0.1:{env['BLOCKSERVE_PORT']}"
    scheduler = start(["-m", "service.launch.cli", "scheduler"], env, tmp_path / "scheduler.log")
    worker = start(["-m", "service.launch.cli", "worker"], env, tmp_path / "worker.log")
    api = start(["-m", "service.launch.cli", "api"], env, tmp_path / "api.log")
    processes = [api, scheduler, worker]
    try:
        wait_ready(url, timeout_s=180)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)
        old_model = client.models.list().data[0].id
        two_tokens = dict(prompt=SHORT_PROMPT, max_tokens=2, extra_body={"ignore_eos": True})
        before = client.completions.create(model=old_model, **two_tokens)
        assert before.usage.completion_tokens == 2

        killed_at: list[float] = []

        def kill_scheduler() -> None:
            wait_until(
                lambda: scrape(env["BLOCKSERVE_METRICS_PORT"])["blockserve_num_requests_running"] == 2,
                30,
                "the two requests never ran together",
            )
            kill(scheduler)
            killed_at.append(time.monotonic())
            kill(worker)

        whole_error, streamed_error = asyncio.run(requests_in_flight_when(kill_scheduler, url, old_model))
        ended_after_s = time.monotonic() - killed_at[0]
        assert isinstance(whole_error, openai.APIStatusError) and whole_error.status_code == 503, whole_error
        assert isinstance(streamed_error, openai.APIError), streamed_error
        assert "scheduler" in whole_error.message and "scheduler" in streamed_error.message
        assert ended_after_s < ERROR_WITHIN_S

        # No scheduler: refused at once, with a reason.
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": SHORT_PROMPT, "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and "scheduler" in refused.json()["error"]["message"]
        assert httpx.get(f"{url}/ready", timeout=10).status_code == 503

        processes += [
            start(["-m", "service.launch.cli", "scheduler"], second_env, tmp_path / "scheduler2.log"),
            start(["-m", "tests.support.fake_worker_process"], second_env, tmp_path / "worker2.log"),
        ]
        wait_ready(url, timeout_s=60)

        new_model = tiny_model_info()
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert [(card["id"], card["max_model_len"]) for card in models] == [(new_model.name, new_model.max_model_len)]
        gone = httpx.post(
            f"{url}/v1/completions", json={"model": old_model, "prompt": SHORT_PROMPT, "max_tokens": 2}, timeout=10
        )
        assert gone.status_code == 404 and old_model in gone.json()["error"]["message"]

        after = client.completions.create(model=new_model.name, **two_tokens)
        num_new_tokens = len(tiny_tokenizer().encode(SHORT_PROMPT, add_special_tokens=False).ids)
        assert num_new_tokens != before.usage.prompt_tokens  # the two tokenizers tell apart
        assert after.usage.prompt_tokens == num_new_tokens and after.usage.completion_tokens == 2

        long_prompt = SHORT_PROMPT * 8
        num_long_tokens = len(tiny_tokenizer().encode(long_prompt, add_special_tokens=False).ids)
        assert num_long_tokens + 2 > new_model.max_model_len
        too_long = httpx.post(
            f"{url}/v1/completions", json={"model": new_model.name, "prompt": long_prompt, "max_tokens": 2}, timeout=10
        )
        message = too_long.json()["error"]["message"]
        assert too_long.status_code == 400, message
        assert f"maximum context length is {new_model.max_model_len} tokens" in message
        assert f"({num_long_tokens} in the prompt" in message
    finally:
        stop_all(processes)


def test_a_live_scheduler_refuses_a_worker_of_another_model_and_takes_back_one_of_its_own(tmp_path):
    """The scheduler stays; its worker dies. Meanwhile requests get 503, streamed or not; a worker of another
    model is refused, not adopted (the api replicas keep the model they were told); a worker of the model
    registers again and is served."""
    env = loopback_env()
    url = f"http://127.0.0.1:{env['BLOCKSERVE_PORT']}"
    worker = start(["-m", "tests.support.fake_worker_process"], env, tmp_path / "worker.log")
    processes = [
        start(["-m", "service.launch.cli", "api"], env, tmp_path / "api.log"),
        start(["-m", "service.launch.cli", "scheduler"], env, tmp_path / "scheduler.log"),
        worker,
    ]
    try:
        wait_ready(url, timeout_s=60)
        models = lambda: [card["id"] for card in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]  # noqa: E731
        model = tiny_model_info().name
        assert models() == [model]
        kill(worker)
        wait_until(lambda: httpx.get(f"{url}/ready", timeout=10).status_code == 503, 30, "still ready")
        body = {"model": model, "prompt": SHORT_PROMPT, "max_tokens": 2}
        for stream in (False, True):
            refused = httpx.post(f"{url}/v1/completions", json={**body, "stream": stream}, timeout=10)
            assert refused.status_code == 503 and "no worker" in refused.json()["error"]["message"], refused.text

        processes.append(
            start(
                ["-m", "tests.support.fake_worker_process"],
                dict(env, FAKE_MODEL_NAME="other-model"),
                tmp_path / "w2.log",
            )
        )
        dropped = lambda: scrape(env["BLOCKSERVE_METRICS_PORT"])["blockserve_dropped_frames_total"]  # noqa: E731
        wait_until(lambda: dropped() >= 1, 60, "the other model's worker was not refused")
        assert "(other_model)" in (tmp_path / "scheduler.log").read_text()
        assert models() == [model] and httpx.get(f"{url}/ready", timeout=10).status_code == 503
        kill(processes[-1])

        processes.append(start(["-m", "tests.support.fake_worker_process"], env, tmp_path / "w3.log"))
        wait_ready(url, timeout_s=60)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)
        served = client.completions.create(
            model=model, prompt=SHORT_PROMPT, max_tokens=2, extra_body={"ignore_eos": True}
        )
        assert served.usage.completion_tokens == 2
    finally:
        stop_all(processes)
