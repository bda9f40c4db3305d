"""No single request, peer or slow step takes the scheduler down: real processes over real sockets."""

from __future__ import annotations

import math
import signal
import time

import httpx
import msgspec
import pytest
import zmq

from service.contract import wire
from service.scheduler.server import API_HEARTBEAT_TIMEOUT_MS, PING_INTERVAL_S
from tests.support.api_peer import ApiPeer
from tests.support.processes import FakeStack, loopback_env, metric_samples, start, stop_all
from tests.support.tiny_model import tiny_model_info

NUM_BLOCKS = 24


def start_cluster(tmp_path, **overrides: str):
    """Scheduler + fake worker process; returns (env, peer, processes) once the scheduler is ready."""
    env = loopback_env(**{"BLOCKSERVE_NUM_KV_BLOCKS": str(NUM_BLOCKS), "BLOCKSERVE_BLOCK_SIZE": "4", **overrides})
    processes = {
        "scheduler": start(["-m", "service.launch.cli", "scheduler"], env, tmp_path / "scheduler.log"),
        "worker": start(["-m", "tests.support.fake_worker_process"], env, tmp_path / "worker.log"),
    }
    peer = ApiPeer(env["BLOCKSERVE_SCHEDULER_ADDR"])
    try:
        peer.wait_until(lambda: peer.status(timeout_s=30).ready, 30)  # a loaded machine starts it slowly
    except BaseException:
        peer.close()
        stop_all(list(processes.values()))
        raise
    return env, peer, processes


@pytest.fixture
def slow_cluster(tmp_path):
    """Every step takes 2.5 s, the worker timeout is 1 s."""
    env, peer, processes = start_cluster(tmp_path, BLOCKSERVE_WORKER_TIMEOUT_S="1", FAKE_STEP_DELAY_S="2.5")
    yield env, peer, processes
    peer.close()
    stop_all(list(processes.values()))


@pytest.fixture
def cluster(tmp_path):
    env, peer, processes = start_cluster(tmp_path, BLOCKSERVE_WORKER_TIMEOUT_S="2", FAKE_STEP_DELAY_S="0.02")
    yield env, peer, processes
    peer.close()
    stop_all(list(processes.values()))


def dropped_frames(env) -> dict[tuple[str, str], float]:
    samples = metric_samples(env["BLOCKSERVE_METRICS_PORT"], "blockserve_dropped_frames_total")
    return {(s.labels["socket"], s.labels["reason"]): s.value for s in samples}


def test_a_step_longer_than_the_worker_timeout_fails_nobody(slow_cluster):
    _, peer, processes = slow_cluster
    request_id = peer.submit([1, 2, 3], max_tokens=2)
    peer.wait_until(lambda: request_id in peer.finished, 15)
    assert peer.finished[request_id].finish_reason == "length" and len(peer.outputs[request_id]) == 2
    assert peer.status().ready


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_worker_lost_during_a_long_step_is_detected_within_seconds(tmp_path, how):
    # A killed worker's connection closes: found at once, long before a 30 s ping timeout. A hung
    # one's stays open: found by its unanswered pings once the timeout since its last pong (up to a
    # ping interval before the stop) is past. Steps outlast the timeout: the missing result decides neither.
    timeout_s = 30.0 if how == "killed" else 3.0
    _, peer, processes = start_cluster(
        tmp_path, BLOCKSERVE_WORKER_TIMEOUT_S=str(timeout_s), FAKE_STEP_DELAY_S=str(3 * timeout_s)
    )
    try:
        request_id = peer.submit([1, 2, 3], max_tokens=4)
        time.sleep(0.5)  # the first step computes
        processes["worker"].send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        elapsed = peer.wait_until(lambda: request_id in peer.finished, 2 * timeout_s)
        assert peer.finished[request_id].error_status == 503
        if how == "killed":
            assert elapsed < timeout_s / 3
        else:
            assert timeout_s - 2 * PING_INTERVAL_S < elapsed < 2 * timeout_s
    finally:
        if how == "hung":
            processes["worker"].send_signal(signal.SIGCONT)
        peer.close()
        stop_all(list(processes.values()))


@pytest.mark.parametrize("frozen", ["worker", "scheduler"])
def test_a_freeze_shorter_than_a_long_worker_timeout_loses_nothing(tmp_path, frozen):
    # One setting decides: neither side's zmq heartbeat (6 s before) may drop the link earlier.
    timeout_s, freeze_s = 30.0, 12.0
    _, peer, processes = start_cluster(tmp_path, BLOCKSERVE_WORKER_TIMEOUT_S=str(timeout_s), FAKE_STEP_DELAY_S="0.02")
    try:
        request_id = peer.submit([1, 2, 3], max_tokens=80)
        peer.wait_until(lambda: len(peer.outputs[request_id]) >= 2, 10)
        processes[frozen].send_signal(signal.SIGSTOP)
        try:
            time.sleep(freeze_s)
        finally:
            processes[frozen].send_signal(signal.SIGCONT)
        peer.wait_until(lambda: request_id in peer.finished, 30)
        assert peer.finished[request_id].finish_reason == "length", peer.finished[request_id].error
        assert len(peer.outputs[request_id]) == 80
        assert peer.status().ready
    finally:
        peer.close()
        stop_all(list(processes.values()))


def test_a_request_the_worker_refuses_gets_a_400_that_says_why(tmp_path):
    with FakeStack(tmp_path, FAKE_REFUSED_SEED="7") as stack:
        model = httpx.get(f"{stack.url}/v1/models", timeout=5).json()["data"][0]["id"]
        body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 4, "seed": 7}
        for stream in (False, True):
            response = httpx.post(f"{stack.url}/v1/completions", json={**body, "stream": stream}, timeout=30)
            assert response.status_code == 400, response.text
            message = response.json()["error"]["message"]
            assert "refused" in message and "seed 7 is refused by this test worker" in message, message
        served = httpx.post(f"{stack.url}/v1/completions", json={**body, "seed": 8}, timeout=30)
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 4


def test_nonsense_sampling_on_the_zmq_path_gets_400_and_an_honest_request_completes(cluster):
    _, peer, processes = cluster
    honest = peer.submit([1, 2, 3], max_tokens=30)
    vocab_size = tiny_model_info().vocab_size
    nonsense = {
        "temperature": {"temperature": math.nan},
        "temperature ": {"temperature": -1.0},
        "top_p": {"top_p": math.inf},
        "top_k": {"top_k": -5},
        "repetition_penalty": {"repetition_penalty": 0.0},
        "presence_penalty": {"presence_penalty": math.nan},
        "logprobs": {"logprobs": 100000},
        "stop token ids": {"stop_token_ids": [vocab_size]},
        "max_tokens": {"max_tokens": 0},
    }
    bad_ids = {}
    for field, overrides in nonsense.items():
        sampling = wire.SamplingParams(**{"max_tokens": 5, **overrides})
        request_id = f"bad-{len(bad_ids)}"
        peer.outputs[request_id] = []
        peer.send(wire.GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2], sampling=sampling))
        bad_ids[request_id] = field.strip()
    long_id = "x" * 1000
    peer.outputs[long_id] = []
    peer.send(wire.GenerateRequest(request_id=long_id, prompt_token_ids=[1], sampling=wire.SamplingParams()))
    bad_ids[long_id] = "request id"
    peer.wait_until(lambda: honest in peer.finished and all(i in peer.finished for i in bad_ids), 20)
    for request_id, field in bad_ids.items():
        delta = peer.finished[request_id]
        assert delta.finish_reason == "error" and delta.error_status == 400, (field, delta)
        assert field in delta.error, (field, delta.error)
    assert peer.finished[honest].finish_reason == "length" and len(peer.outputs[honest]) == 30
    assert processes["scheduler"].poll() is None


def test_nonsense_hellos_and_frames_are_dropped_counted_and_the_scheduler_lives(cluster):
    env, peer, processes = cluster
    model = tiny_model_info()
    hellos = [
        wire.WorkerHello(worker_id="zero", num_kv_blocks=0, block_size=4, model=model),
        wire.WorkerHello(worker_id="negative", num_kv_blocks=-3, block_size=4, model=model),
        wire.WorkerHello(worker_id="no-block-size", num_kv_blocks=8, block_size=0, model=model),
        wire.WorkerHello(
            worker_id="no-vocab", num_kv_blocks=8, block_size=4, model=msgspec.structs.replace(model, vocab_size=0)
        ),
    ]
    context = zmq.Context()
    intruder = context.socket(zmq.DEALER)
    intruder.linger = 0
    intruder.connect(env["BLOCKSERVE_WORKER_ADDR"])
    for hello in hellos:
        intruder.send(wire.encode(hello))
    intruder.send(wire.encode(wire.StepResult(step_id=1)))  # not the registered worker
    peer.send(wire.Pong())  # not a message the api socket takes
    try:
        request_id = peer.submit([1, 2, 3], max_tokens=5)
        peer.wait_until(lambda: request_id in peer.finished, 20)
        assert len(peer.outputs[request_id]) == 5
        status = peer.status()
        assert status.ready and status.num_total_blocks == NUM_BLOCKS  # the honest worker's table stands
        assert processes["scheduler"].poll() is None
        dropped = dropped_frames(env)
        assert dropped[("worker", "invalid")] == len(hellos)
        assert dropped[("worker", "unknown_worker")] == 1
        assert dropped[("api", "unexpected")] == 1
    finally:
        context.destroy(linger=0)


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_an_api_replica_lost_mid_stream_has_its_requests_aborted_and_blocks_freed(tmp_path, how):
    with FakeStack(tmp_path, FAKE_STEP_DELAY_S="0.2") as stack:
        api = stack.processes["api"]
        model = httpx.get(f"{stack.url}/v1/models", timeout=5).json()["data"][0]["id"]
        body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 80, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=10) as response:
            next(response.iter_lines())  # streaming: the scheduler holds its blocks
            api.send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        lost_at = time.monotonic()
        peer = ApiPeer(stack.env["BLOCKSERVE_SCHEDULER_ADDR"])
        try:
            # 80 tokens take 16 s; a kill closes the connection at once (well before the zmq heartbeat
            # could tell), a hung replica's is closed by the heartbeat, soon after its timeout.
            heartbeat_s = API_HEARTBEAT_TIMEOUT_MS / 1000
            peer.wait_until(lambda: peer.status().num_free_blocks == NUM_BLOCKS, 2 * heartbeat_s)  # its step back
            assert time.monotonic() - lost_at < (heartbeat_s / 2 if how == "killed" else 2 * heartbeat_s)
            status = peer.status()
            assert status.num_running == status.num_waiting == 0 and status.num_total_blocks == NUM_BLOCKS
            finished = metric_samples(stack.env["BLOCKSERVE_METRICS_PORT"], "blockserve_requests_finished_total")
            assert {s.labels["reason"]: s.value for s in finished if s.value}.keys() == {"abort"}
        finally:
            peer.close()
            if how == "hung":
                api.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("overlapped", ["0", "1"])
def test_streams_keep_receiving_tokens_while_a_maximal_prompt_prefills(tmp_path, overlapped):
    budget, num_streams = 8, 3
    _, peer, processes = start_cluster(
        tmp_path,
        BLOCKSERVE_NUM_KV_BLOCKS="64",
        BLOCKSERVE_BLOCK_SIZE="16",
        BLOCKSERVE_MAX_NUM_BATCHED_TOKENS=str(budget),
        BLOCKSERVE_ASYNC_SCHEDULING=overlapped,
        FAKE_STEP_DELAY_S="0.01",
    )
    try:
        max_model_len = tiny_model_info().max_model_len
        streams = [peer.submit([1, 2, 3], max_tokens=max_model_len - 4) for _ in range(num_streams)]
        peer.wait_until(lambda: all(len(peer.outputs[s]) >= 2 for s in streams), 15)
        before = {s: len(peer.outputs[s]) for s in streams}
        maximal = peer.submit([5] * (max_model_len - 1), max_tokens=1)
        peer.wait_until(lambda: maximal in peer.finished, 30)
        # The prompt needs at least this many steps with the decodes' tokens taken from the budget first.
        prefill_steps = math.ceil((max_model_len - 1) / (budget - num_streams))
        received = {s: len(peer.outputs[s]) - before[s] for s in streams}
        assert all(s not in peer.finished for s in streams)
        assert all(count >= prefill_steps - 2 for count in received.values()), (received, prefill_steps)
    finally:
        peer.close()
        stop_all(list(processes.values()))
