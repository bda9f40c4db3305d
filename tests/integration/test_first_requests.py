"""Honest from the first request: no request, however shaped, stops the scheduler, and an error inside
its core ends the requests of that moment with a clear error while the loop serves on."""

from __future__ import annotations

import threading

import msgspec
import openai
import pytest

from service.contract import wire
from service.contract.config import load_settings
from service.scheduler.server import SchedulerServer
from tests.support.api_peer import ApiPeer
from tests.support.processes import loopback_env, metric_samples, start, stop_all, wait_ready
from tests.support.scripted_worker import BLOCK_SIZE, NUM_BLOCKS, ScriptedWorker
from tests.support.tiny_model import MODEL_NAME


@pytest.fixture
def in_process(monkeypatch):
    """A scheduler server in this process over inproc:// sockets, a scripted worker and an api peer."""
    env = loopback_env(
        BLOCKSERVE_SCHEDULER_ADDR="inproc://api",
        BLOCKSERVE_WORKER_ADDR="inproc://worker",
        BLOCKSERVE_NUM_KV_BLOCKS=str(NUM_BLOCKS),
        BLOCKSERVE_BLOCK_SIZE=str(BLOCK_SIZE),
        BLOCKSERVE_WORKER_TIMEOUT_S="10",
    )
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    server = SchedulerServer(load_settings())
    worker = ScriptedWorker("inproc://worker", context=server.context)
    peer = ApiPeer("inproc://api", context=server.context)

    def turn() -> bool:
        server.serve_once(0)
        worker.answer()
        peer.pump(0)
        return False

    worker.hello()
    peer.send(wire.StatusQuery())
    peer.wait_until(lambda: turn() or any(status.ready for status in peer.statuses), 5)
    try:
        yield server, peer, turn, worker
    finally:
        peer.close()
        worker.close()
        server.close()


@pytest.mark.parametrize("part", ["schedule", "update"])
def test_an_error_inside_the_scheduler_core_ends_its_requests_with_500_and_the_loop_serves_on(in_process, part):
    server, peer, turn, _ = in_process
    running = peer.submit([1, 2, 3], max_tokens=60)
    peer.wait_until(lambda: turn() or len(peer.outputs[running]) >= 2, 5)
    scheduler = server.scheduler
    method = "schedule" if part == "schedule" else "update"
    original = getattr(scheduler, method)

    def fails_once(*args, **kwargs):
        setattr(scheduler, method, original)
        raise RuntimeError("a bug in the core")

    setattr(scheduler, method, fails_once)
    peer.wait_until(lambda: turn() or running in peer.finished, 5)
    ended = peer.finished[running]
    assert (ended.finish_reason, ended.error_status) == ("error", 500)
    assert "internal error in the scheduler" in ended.error
    errors = server.metrics.registry.get_sample_value("blockserve_step_loop_errors_total", {"part": part})
    assert errors == 1
    assert scheduler.kv.pool.num_free_blocks == NUM_BLOCKS
    after = peer.submit([4, 5, 6], max_tokens=8)
    peer.wait_until(lambda: turn() or after in peer.finished, 5)
    assert peer.finished[after].finish_reason == "length" and len(peer.outputs[after]) == 8


def test_a_failing_step_cost_model_is_counted_and_scheduling_goes_on(in_process):
    server, peer, turn, worker = in_process
    scheduler = server.scheduler
    execute = worker.fake.execute
    worker.fake.execute = lambda step: msgspec.structs.replace(execute(step), compute_s=0.01)  # timed steps
    warm = peer.submit([7, 8, 9], max_tokens=3)  # the model learns from these
    peer.wait_until(lambda: turn() or warm in peer.finished, 5)
    assert scheduler.step_cost.num_observations > 0

    def broken(*args):
        raise FloatingPointError("a broken fit")

    scheduler.step_cost.observe = broken
    scheduler.step_cost.prefill_tokens_within = broken
    request = peer.submit(list(range(1, 40)), max_tokens=6)
    peer.wait_until(lambda: turn() or request in peer.finished, 5)
    assert peer.finished[request].finish_reason == "length" and len(peer.outputs[request]) == 6
    errors = server.metrics.registry.get_sample_value("blockserve_step_cost_errors_total", {"model_name": MODEL_NAME})
    assert errors >= 2  # one learning from a step, one sizing a chunk


@pytest.fixture(scope="module")
def fresh_stack(tmp_path_factory):
    """scheduler + worker (default model and settings) + api as processes, started for this module."""
    logs = tmp_path_factory.mktemp("fresh_stack")
    env = loopback_env()
    processes = {
        role: start(["-m", "service.launch.cli", role], env, logs / f"{role}.log")
        for role in ("scheduler", "worker", "api")
    }
    url = f"http://127.0.0.1:{env['BLOCKSERVE_PORT']}"
    try:
        wait_ready(url, timeout_s=180)
        yield env, url, processes
    finally:
        stop_all(processes.values())


def test_sixty_four_choices_of_a_one_token_prompt_then_24_concurrent_prompts_on_a_fresh_server(fresh_stack):
    """The request that once made the step cost fit raise (as many requests as tokens in every step), three
    times, then 24 concurrent one-token prompts: every one answered, no role exits."""
    env, url, processes = fresh_stack
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    for _ in range(3):
        completion = client.completions.create(model=model, prompt="The", n=64, max_tokens=16)
        assert len(completion.choices) == 64 and all(choice.text for choice in completion.choices)
    answers: list[str] = []

    def one_token(index: int) -> None:
        completion = client.completions.create(model=model, prompt=f"{index}", max_tokens=1)
        answers.append(completion.choices[0].finish_reason)

    threads = [threading.Thread(target=one_token, args=(index,)) for index in range(24)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert len(answers) == 24
    assert all(process.poll() is None for process in processes.values())
    port = env["BLOCKSERVE_METRICS_PORT"]
    assert sum(s.value for s in metric_samples(port, "blockserve_step_loop_errors_total")) == 0
    assert sum(s.value for s in metric_samples(port, "blockserve_step_cost_errors_total")) == 0
