"""Many tenants, one table, over real processes: a scheduler with a model-free worker and the real api,
driven by the official openai client; tenants named by OpenAI's `user` field and by API keys."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from tests.support.processes import FakeStack, metric_samples

FLOOD = 32  # four times the seats


def client(stack: FakeStack, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=api_key, max_retries=0, timeout=120)


def waiting(stack: FakeStack) -> float:
    return sum(sample.value for sample in metric_samples(stack.metrics_port, "blockserve_num_requests_waiting"))


def flood_then_quiet(stack: FakeStack) -> int:
    """A flooding tenant queues four times the seats; then a quiet tenant sends one request. Returns how many
    of the flood's requests had finished when the quiet one did."""
    openai_client = client(stack)
    model = openai_client.models.list().data[0].id
    finished: list[str] = []

    def flood_one(index: int) -> None:
        openai_client.completions.create(model=model, prompt=f"flood {index}", max_tokens=60, user="flood")
        finished.append(f"flood-{index}")

    threads = [threading.Thread(target=flood_one, args=(index,)) for index in range(FLOOD)]
    for thread in threads:
        thread.start()
    deadline = 200
    while waiting(stack) < FLOOD - 8 and deadline:
        deadline -= 1
        threading.Event().wait(0.05)
    assert waiting(stack) >= FLOOD - 8, "the flood is not queued"
    openai_client.completions.create(model=model, prompt="quiet", max_tokens=4, user="quiet")
    finished_before_quiet = len(finished)
    for thread in threads:
        thread.join(120)
    assert len(finished) == FLOOD
    return finished_before_quiet


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_a_quiet_tenant_is_served_beside_a_flooding_one_under_fair_and_behind_it_under_fcfs(tmp_path, policy):
    settings = dict(
        BLOCKSERVE_SCHEDULING_POLICY=policy,
        BLOCKSERVE_MAX_NUM_SEQS="8",
        BLOCKSERVE_NUM_KV_BLOCKS="512",
        # A flood request holds its seat 60 steps: 1.8 s, time for all 32 to arrive before a seat frees (at 10 ms a
        # step, on a 2-core machine running the suite, one had finished when the last arrived: 23 queued, not 24).
        FAKE_STEP_DELAY_S="0.03",
    )
    with FakeStack(tmp_path, **settings) as stack:
        finished_before_quiet = flood_then_quiet(stack)
        labels = {
            s.labels["tenant"] for s in metric_samples(stack.metrics_port, "blockserve_tenant_prompt_tokens_total")
        }
    if policy == "fair":
        assert finished_before_quiet <= 8  # at most the seats the flood held when the quiet request came
    else:
        assert finished_before_quiet >= FLOOD - 8  # first come, first served: behind the whole queue
    assert labels == {"flood", "quiet"}


def test_a_tenant_beyond_its_most_queued_requests_gets_429_with_retry_after_and_others_are_served(tmp_path):
    settings = dict(
        BLOCKSERVE_SCHEDULING_POLICY="fair",
        BLOCKSERVE_MAX_NUM_SEQS="1",
        BLOCKSERVE_TENANT_MAX_QUEUED="2",
        FAKE_STEP_DELAY_S="0.02",
    )
    with FakeStack(tmp_path, **settings) as stack:
        model = client(stack).models.list().data[0].id
        statuses: dict[str, list[int]] = {"greedy": [], "other": []}

        def send(user: str) -> None:
            body = {"model": model, "prompt": "hello", "max_tokens": 30, "user": user}
            response = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60)
            statuses[user].append(response.status_code)
            if response.status_code == 429:
                assert response.headers["Retry-After"] == "1"
                assert "too many requests of this tenant are queued" in response.json()["error"]["message"]

        threads = [threading.Thread(target=send, args=("greedy",)) for _ in range(6)]
        for thread in threads:
            thread.start()
            threading.Event().wait(0.05)
        send("other")
        for thread in threads:
            thread.join(60)
    assert statuses["other"] == [200]  # another tenant is served meanwhile
    assert sorted(statuses["greedy"]) == [200, 200, 200, 429, 429, 429]  # one running, two queued, the rest refused


def test_api_keys_name_their_tenant_and_weight_and_other_keys_are_refused(tmp_path):
    keys = {"key-of-acme": {"tenant": "acme", "weight": 2}, "key-of-beta": "beta"}
    settings = dict(BLOCKSERVE_SCHEDULING_POLICY="fair", BLOCKSERVE_API_KEYS=json.dumps(keys))
    with FakeStack(tmp_path, **settings) as stack:
        acme = client(stack, "key-of-acme")
        model = acme.models.list().data[0].id
        acme.completions.create(model=model, prompt="hi", max_tokens=2, user="someone-else")  # the key decides
        client(stack, "key-of-beta").completions.create(model=model, prompt="hi", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            client(stack, "key-of-nobody").completions.create(model=model, prompt="hi", max_tokens=2)
        samples = metric_samples(stack.metrics_port, "blockserve_tenant_prompt_tokens_total")
    assert {s.labels["tenant"] for s in samples if s.value > 0} == {"acme", "beta"}
