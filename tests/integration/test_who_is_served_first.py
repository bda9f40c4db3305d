"""Who is served first, over real processes: priorities take seats from lower ones, and a long
prompt's prefill leaves room for short requests (the step budget in time)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.support.api_peer import ApiPeer
from tests.support.fake_scheduler import ApiServer, FakeScheduler
from tests.support.processes import FakeStack, loopback_env, start, stop_all
from tests.support.tiny_model import MAX_MODEL_LEN, MODEL_NAME


@pytest.fixture
def priority_cluster(tmp_path):
    """Scheduler (priority policy, 4 seats) + fake worker; yields an ApiPeer on the api socket."""
    env = loopback_env(
        BLOCKSERVE_NUM_KV_BLOCKS="256",
        BLOCKSERVE_BLOCK_SIZE="4",
        BLOCKSERVE_MAX_NUM_SEQS="4",
        BLOCKSERVE_SCHEDULING_POLICY="priority",
        FAKE_STEP_DELAY_S="0.02",
    )
    processes = [
        start(["-m", "service.launch.cli", "scheduler"], env, tmp_path / "scheduler.log"),
        start(["-m", "tests.support.fake_worker_process"], env, tmp_path / "worker.log"),
    ]
    peer = ApiPeer(env["BLOCKSERVE_SCHEDULER_ADDR"])
    peer.wait_until(lambda: peer.status().ready, 30)
    yield peer
    peer.close()
    stop_all(processes)


def test_a_high_priority_request_takes_a_seat_from_low_priority_streams_within_a_few_steps(priority_cluster):
    peer = priority_cluster
    lows = [peer.submit([5 + i, 6, 7], max_tokens=100, priority=5) for i in range(4)]
    peer.wait_until(lambda: all(len(peer.outputs[r]) >= 3 for r in lows), 30)
    frames_before = len(peer.batch_sizes)
    high = peer.submit([9, 9, 9], max_tokens=4, priority=0)
    peer.wait_until(lambda: peer.outputs[high], 30)
    # A step sends one frame with tokens (the low streams decode in every step); report-only frames carry none.
    steps = sum(1 for size in peer.batch_sizes[frames_before:] if size)
    assert steps <= 4  # its first token within 4 steps
    peer.wait_until(lambda: len(peer.finished) == 5, 60)
    assert all(peer.finished[r].finish_reason == "length" and len(peer.outputs[r]) == 100 for r in lows)


def test_the_api_passes_the_priority_of_a_request_to_the_scheduler():
    with FakeScheduler() as fake, ApiServer(fake.addr) as api:
        api.wait_ready()
        for body in ({"prompt": "Hello", "priority": -3}, {"prompt": "Hello"}):
            reply = httpx.post(f"{api.base_url}/v1/completions", json={"model": MODEL_NAME, "max_tokens": 2, **body})
            assert reply.status_code == 200
        assert [request.priority for request in fake.generated] == [-3, 0]
        too_big = httpx.post(
            f"{api.base_url}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "priority": 2**40}
        )
        assert too_big.status_code == 400 and "priority" in too_big.text


def test_short_requests_keep_getting_first_tokens_while_a_long_prompt_prefills(tmp_path):
    """A worker whose step costs 5 ms + 10 ms a token, a 32-token budget and a 100 ms target: a prompt
    of most of the context takes the whole budget while it is alone (its first step), then, once
    short requests wait, steps of about 100 ms; short requests sent one after another each get their
    first token before it is done (without the target they would wait for its 32-token steps)."""
    env = dict(
        BLOCKSERVE_NUM_KV_BLOCKS="256",
        BLOCKSERVE_BLOCK_SIZE="4",
        BLOCKSERVE_MAX_NUM_BATCHED_TOKENS="32",
        BLOCKSERVE_TARGET_ITL_MS="100",
        FAKE_STEP_DELAY_S="0.005",
        FAKE_TOKEN_DELAY_S="0.01",
    )
    with FakeStack(tmp_path, **env) as stack:
        for length in (4, 12, 30, 60):  # steps of several sizes teach the scheduler what a token costs
            body = {"model": MODEL_NAME, "prompt": [7] * length, "max_tokens": 4, "ignore_eos": True}
            assert httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60).status_code == 200
        long_done = threading.Event()

        def long_prompt() -> None:
            body = {"model": MODEL_NAME, "prompt": [8] * (MAX_MODEL_LEN - 8), "max_tokens": 1, "ignore_eos": True}
            httpx.post(f"{stack.url}/v1/completions", json=body, timeout=120)
            long_done.set()

        thread = threading.Thread(target=long_prompt)
        thread.start()
        time.sleep(0.1)
        num_short = 0
        while not long_done.is_set():
            body = {"model": MODEL_NAME, "prompt": [9, 9, 9], "max_tokens": 1, "ignore_eos": True}
            assert httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60).status_code == 200
            num_short += long_done.is_set() is False
        thread.join()
        assert num_short >= 2
