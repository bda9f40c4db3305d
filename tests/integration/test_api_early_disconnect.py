"""Clients that leave before their first token: an ordinary event, not a server error.

The real api, scheduler and a model-free worker whose step takes seconds, as processes; 40 streaming
completions whose clients give up after half a second, long before the first step ends.
"""

from __future__ import annotations

import asyncio

import openai

from tests.support.fake_scheduler import wait_until
from tests.support.processes import FakeStack, metric_samples, scrape
from tests.support.tiny_model import MODEL_NAME

NUM_CLIENTS = 40
PATIENCE_S = 0.5
STEP_S = 3.0  # the first token comes after a step at least


async def leave_before_the_first_token(url: str) -> list[BaseException | None]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=PATIENCE_S)

    async def one(index: int) -> None:
        prompt = [10 + index % 50, *range(20, 36)]
        async for _ in await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, stream=True):
            pass

    try:
        return await asyncio.gather(*(one(index) for index in range(NUM_CLIENTS)), return_exceptions=True)
    finally:
        await client.close()


def completion_statuses(stack: FakeStack) -> dict[str, float]:
    samples = metric_samples(stack.env["BLOCKSERVE_PORT"], "blockserve_api_http_requests_total")
    return {s.labels["status_code"]: s.value for s in samples if s.labels["route"] == "/v1/completions" and s.value}


def test_clients_leaving_before_their_first_token_are_counted_499_without_a_traceback_and_free_every_block(tmp_path):
    env = dict(BLOCKSERVE_NUM_KV_BLOCKS="512", FAKE_STEP_DELAY_S=str(STEP_S), BLOCKSERVE_LOG_LEVEL="INFO")
    with FakeStack(tmp_path, **env) as stack:
        outcomes = asyncio.run(leave_before_the_first_token(stack.url))
        assert all(isinstance(outcome, openai.APITimeoutError) for outcome in outcomes), outcomes
        wait_until(lambda: sum(completion_statuses(stack).values()) == NUM_CLIENTS, timeout_s=10)
        assert completion_statuses(stack) == {"499": NUM_CLIENTS}

        def every_block_free() -> bool:
            engine = scrape(stack.metrics_port)
            return engine["blockserve_kv_blocks_free"] == engine["blockserve_kv_blocks_capacity"]

        wait_until(every_block_free, timeout_s=4 * STEP_S)
        finished = metric_samples(stack.metrics_port, "blockserve_requests_finished_total")
        assert {s.labels["reason"]: s.value for s in finished if s.value} == {"abort": NUM_CLIENTS}
    api_log = (tmp_path / "api.log").read_text()
    assert "Traceback" not in api_log and "Exception" not in api_log, api_log[-3000:]
