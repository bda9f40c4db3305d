"""Many engines act as one: an api routes every request on load and on exact prefix knowledge."""

from __future__ import annotations

import random
import signal
import threading
import time

import httpx

from service.contract import socket_auth
from tests.support.fake_scheduler import wait_until
from tests.support.processes import FakeStack, free_port, metric_samples, scrape, start, stop_all
from tests.support.tiny_model import MODEL_NAME


def complete(url: str, prompt: list[int], max_tokens: int = 2) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def run_concurrently(jobs, num_threads: int) -> list:
    """Run the callables `jobs` on `num_threads` threads; their results in order."""
    results: list = [None] * len(jobs)
    pending = list(enumerate(jobs))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not pending:
                    return
                index, job = pending.pop(0)
            results[index] = job()

    threads = [threading.Thread(target=work) for _ in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def requests_per_engine(stack: FakeStack) -> dict[str, float]:
    samples = metric_samples(stack.env["BLOCKSERVE_PORT"], "blockserve_api_engine_requests_total")
    return {sample.labels["engine"]: sample.value for sample in samples}


def test_two_engines_share_a_uniform_load(tmp_path):
    with FakeStack(tmp_path, num_engines=2, BLOCKSERVE_NUM_KV_BLOCKS="128", FAKE_STEP_DELAY_S="0.02") as stack:
        rng = random.Random(1)
        prompts = [[rng.randrange(3, 300) for _ in range(12)] for _ in range(40)]
        replies = run_concurrently([lambda p=p: complete(stack.url, p, 4) for p in prompts], num_threads=8)
        assert all(reply.status_code == 200 for reply in replies)
        shares = requests_per_engine(stack)
        assert set(shares) == {engine["BLOCKSERVE_SCHEDULER_ADDR"] for engine in stack.engines}
        assert all(0.4 <= count / 40 <= 0.6 for count in shares.values()), shares
        finished = [
            scrape(engine["BLOCKSERVE_METRICS_PORT"])["blockserve_requests_finished_total"] for engine in stack.engines
        ]
        assert sum(finished) == 40 and min(finished) >= 16  # the engines' own counts agree


def prefix_cache_hits(routing: str, tmp_path) -> float:
    """Prompt tokens the engines served from their prefix caches for one shared-prefix trace: 8 system
    prompts of 48 tokens (12 blocks) x 6 users, in random order, one after another (so the figure does
    not depend on timing); each engine's cache holds about five."""
    env = dict(BLOCKSERVE_NUM_KV_BLOCKS="72", BLOCKSERVE_ROUTING=routing, FAKE_STEP_DELAY_S="0.01")
    with FakeStack(tmp_path / routing, num_engines=2, **env) as stack:
        rng = random.Random(7)
        systems = [[rng.randrange(3, 300) for _ in range(48)] for _ in range(8)]
        trace = [system + [rng.randrange(3, 300) for _ in range(6)] for system in systems for _ in range(6)]
        rng.shuffle(trace)
        # One at a time: each routing decision sees the caches as the previous requests left them.
        replies = run_concurrently([lambda p=p: complete(stack.url, p) for p in trace], num_threads=1)
        assert all(reply.status_code == 200 for reply in replies)
        return sum(
            scrape(engine["BLOCKSERVE_METRICS_PORT"])["blockserve_prefix_cache_hits_total"] for engine in stack.engines
        )


def test_prefix_routing_serves_a_shared_prefix_trace_from_the_caches_far_more_than_round_robin(tmp_path):
    by_prefix, by_turn = prefix_cache_hits("prefix", tmp_path), prefix_cache_hits("round_robin", tmp_path)
    assert by_prefix >= 1.5 * by_turn, (by_prefix, by_turn)
    assert by_prefix >= 0.6 * 40 * 48  # most of the 40 repeat visits find their 48-token system prompt


def test_prompts_of_a_new_prefix_sent_at_once_are_computed_on_one_engine(tmp_path):
    """Pairs of prompts of a new 48-token prefix (12 blocks), the two of a pair at once, pair after pair: the
    second is routed before the engines report the first one's blocks, yet follows it, so each prefix is
    cached on one engine only (each prompt adds one block of its own)."""
    env = dict(BLOCKSERVE_NUM_KV_BLOCKS="128", FAKE_STEP_DELAY_S="0.05")
    with FakeStack(tmp_path, num_engines=2, **env) as stack:
        rng = random.Random(11)
        for _ in range(4):
            prefix = [rng.randrange(3, 300) for _ in range(48)]
            pair = [lambda user=user: complete(stack.url, prefix + [user, 5, 6]) for user in (3, 4)]
            assert [reply.status_code for reply in run_concurrently(pair, num_threads=2)] == [200, 200]
        cached = [scrape(engine["BLOCKSERVE_METRICS_PORT"])["blockserve_kv_blocks_cached"] for engine in stack.engines]
        assert sum(cached) == 4 * (12 + 2), cached  # not 4 * 2 * (12 + 1): no prefix on both engines


def test_one_set_of_curve_keys_serves_every_engine(tmp_path):
    """As the chart deploys them: every engine has the one server key pair and admits the one api key."""
    pairs = {owner: socket_auth.new_key_pair() for owner in socket_auth.KEY_OWNERS}
    role_keys = socket_auth.key_settings(pairs)
    with FakeStack(tmp_path, num_engines=2, role_env=role_keys, BLOCKSERVE_ROUTING="round_robin") as stack:
        replies = [complete(stack.url, [5 + i, 6, 7], 2) for i in range(6)]
        assert [reply.status_code for reply in replies] == [200] * 6
        assert sorted(requests_per_engine(stack).values()) == [3, 3]
        for engine in stack.engines:  # the handshakes were CURVE ones: none refused, on either socket
            assert scrape(engine["BLOCKSERVE_METRICS_PORT"]).get("blockserve_auth_failures_total", 0) == 0
        plain = stack.env | {"BLOCKSERVE_PORT": str(free_port())}  # an api without the keys gets nowhere
        api = start(["-m", "service.launch.cli", "api"], plain, tmp_path / "plain-api.log")
        try:
            time.sleep(3)
            assert httpx.get(f"http://127.0.0.1:{plain['BLOCKSERVE_PORT']}/ready", timeout=5).status_code == 503
        finally:
            stop_all([api])
        refused = [scrape(e["BLOCKSERVE_METRICS_PORT"]).get("blockserve_auth_failures_total", 0) for e in stack.engines]
        assert all(count > 0 for count in refused), refused  # each engine turned the plain api away


def test_when_an_engine_dies_its_requests_end_with_a_503_and_later_ones_go_to_the_other(tmp_path):
    with FakeStack(tmp_path, num_engines=2, BLOCKSERVE_NUM_KV_BLOCKS="128", FAKE_STEP_DELAY_S="0.05") as stack:
        long_streams = run_concurrently_in_background(stack.url, 6)
        victim = stack.processes["scheduler-0"]
        threading.Event().wait(1.0)  # every stream has started
        victim.send_signal(signal.SIGKILL)
        statuses = long_streams.join()
        assert 503 in statuses and set(statuses) <= {200, 503}
        assert all(complete(stack.url, [5, 6, 7]).status_code == 200 for _ in range(6))
        assert httpx.get(f"{stack.url}/ready", timeout=10).status_code == 200  # one engine is enough


def test_when_the_engine_of_the_replicas_model_dies_an_engine_of_another_model_does_not_take_over(tmp_path):
    stack = FakeStack(tmp_path, num_engines=2, BLOCKSERVE_NUM_KV_BLOCKS="128")
    stack.engines[1]["FAKE_MODEL_NAME"] = "other-model"
    with stack:
        models = lambda: httpx.get(f"{stack.url}/v1/models", timeout=10)  # noqa: E731
        wait_until(lambda: [card["id"] for card in models().json()["data"]] == [MODEL_NAME], timeout_s=30)
        stack.processes["scheduler-0"].send_signal(signal.SIGKILL)
        wait_until(lambda: httpx.get(f"{stack.url}/ready", timeout=10).status_code == 503, timeout_s=30)
        assert models().status_code == 503 and MODEL_NAME in models().json()["error"]["message"]
        for model in (MODEL_NAME, "other-model", None):
            body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 2}
            reply = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=10)
            assert reply.status_code == 503, (model, reply.text)


class run_concurrently_in_background:
    """`count` non-streamed completions of 60 tokens, each on its own thread; `join()` gives their statuses."""

    def __init__(self, url: str, count: int):
        self.statuses: list[int] = []
        self.threads = [threading.Thread(target=self._one, args=(url, i)) for i in range(count)]
        for thread in self.threads:
            thread.start()

    def _one(self, url: str, index: int) -> None:
        self.statuses.append(complete(url, [10 + index, 11, 12], max_tokens=60).status_code)

    def join(self) -> list[int]:
        for thread in self.threads:
            thread.join()
        return self.statuses


def test_engines_found_by_dns_are_used_and_dropped_when_the_name_stops_naming_them(monkeypatch):
    """localhost resolves to the scheduler's loopback address: the api finds it, serves from it, and
    drops it (its requests ending) once the name no longer resolves to it."""
    from service.api import engines
    from tests.support.fake_scheduler import ApiServer, FakeScheduler, free_tcp_addr

    addr = free_tcp_addr()
    port = addr.rsplit(":", 1)[1]
    monkeypatch.setattr(engines, "DISCOVERY_INTERVAL_S", 0.2)
    with FakeScheduler(addr) as fake, ApiServer("", engine_discovery=f"dns://localhost:{port}") as api:
        api.wait_ready()
        reply = httpx.post(
            f"{api.base_url}/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
        )
        assert reply.status_code == 200 and len(fake.generated) == 1
        fake.lose_requests = True  # a request that stays open on the engine
        pending = threading.Thread(
            target=lambda: statuses.append(
                httpx.post(
                    f"{api.base_url}/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi"}, timeout=30
                ).status_code
            )
        )
        statuses: list[int] = []
        pending.start()
        threading.Event().wait(0.5)

        async def nowhere(_discovery: str) -> list[str]:
            return ["tcp://127.0.0.1:9"]  # the name now points elsewhere (nothing listens there)

        monkeypatch.setattr(engines, "resolve", nowhere)
        pending.join(timeout=20)
        assert statuses == [503]  # the request on the engine that went away ended
        assert httpx.get(f"{api.base_url}/ready", timeout=10).status_code == 503


def test_an_engine_that_comes_back_is_used_again(tmp_path):
    from tests.support.processes import start, wait_ready

    with FakeStack(tmp_path, num_engines=2, BLOCKSERVE_NUM_KV_BLOCKS="128") as stack:
        stack.processes["scheduler-0"].send_signal(signal.SIGKILL)
        stack.processes["scheduler-0"].wait()
        assert all(complete(stack.url, [5, 6, i]).status_code == 200 for i in range(4))  # the other engine serves
        before = requests_per_engine(stack).get(stack.engines[0]["BLOCKSERVE_SCHEDULER_ADDR"], 0.0)
        stack.processes["scheduler-0"] = start(
            ["-m", "service.launch.cli", "scheduler"], stack.engines[0], tmp_path / "scheduler-0-again.log"
        )
        wait_ready(stack.url)
        deadline = threading.Event()
        for attempt in range(200):  # until its worker has registered again and the api routes to it
            assert complete(stack.url, [7, 8, attempt]).status_code == 200
            if requests_per_engine(stack).get(stack.engines[0]["BLOCKSERVE_SCHEDULER_ADDR"], 0.0) > before:
                break
            deadline.wait(0.1)
        else:
            raise AssertionError("the engine that came back never got a request")
