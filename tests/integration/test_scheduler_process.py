"""The scheduler process over real ZMQ sockets, with a scripted model-free worker process."""

from __future__ import annotations

import os
import signal

import pytest

from service.contract import wire
from tests.support.api_peer import ApiPeer
from tests.support.processes import loopback_env, metric_samples, scrape, start, stop, stop_all

MODES = {"serial": "0", "overlapped": "1"}
BOTH_MODES = pytest.mark.parametrize("cluster", MODES, indirect=True)


@pytest.fixture
def cluster(request, tmp_path):
    """Scheduler + fake worker (step loop "overlapped" unless parametrized); yields (env, peer, processes)."""
    env = loopback_env(
        BLOCKSERVE_NUM_KV_BLOCKS="24",
        BLOCKSERVE_BLOCK_SIZE="4",
        BLOCKSERVE_WORKER_TIMEOUT_S="2",
        BLOCKSERVE_ASYNC_SCHEDULING=MODES[getattr(request, "param", "overlapped")],
        FAKE_STEP_DELAY_S="0.03",
    )
    processes = {
        "scheduler": start(["-m", "service.launch.cli", "scheduler"], env, tmp_path / "scheduler.log"),
        "worker": start(["-m", "tests.support.fake_worker_process"], env, tmp_path / "worker.log"),
    }
    peer = ApiPeer(env["BLOCKSERVE_SCHEDULER_ADDR"])
    peer.wait_until(lambda: peer.status().ready, 30)
    yield env, peer, processes
    peer.close()
    stop_all(list(processes.values()))


@BOTH_MODES
def test_many_requests_on_a_tight_cache_all_finish_and_free_every_block(cluster):
    env, peer, _ = cluster
    ids = [peer.submit([5 + i, 6, 7, 8, 9], max_tokens=20) for i in range(16)]
    peer.wait_until(lambda: len(peer.finished) == len(ids), 60)
    assert all(len(peer.outputs[i]) == 20 and peer.finished[i].finish_reason == "length" for i in ids)
    assert max(peer.batch_sizes) > 1 and sum(peer.batch_sizes) == 16 * 20  # one frame per step, not per token
    status = peer.status()
    assert status.num_free_blocks == status.num_total_blocks == 24
    assert status.num_running == status.num_waiting == 0
    samples = scrape(env["BLOCKSERVE_METRICS_PORT"])
    assert samples["blockserve_generation_tokens_total"] == 16 * 20
    assert samples["blockserve_prompt_tokens_total"] == 16 * 5
    assert samples["blockserve_num_preemptions_total"] > 0  # 16 x 7 blocks wanted, 24 held
    assert samples["blockserve_request_preemptions_sum"] == samples["blockserve_num_preemptions_total"]
    assert samples["blockserve_requests_finished_total"] == 16
    assert samples["blockserve_kv_cache_usage_ratio"] == 0.0
    assert samples["blockserve_kv_blocks_free"] == samples["blockserve_kv_blocks_capacity"] == 24
    assert samples["blockserve_time_to_first_token_seconds_count"] == 16
    assert samples["blockserve_inter_token_latency_seconds_count"] == 16 * 19


def test_malformed_frames_are_dropped_and_service_continues(cluster):
    _, peer, processes = cluster
    peer.socket.send(b"\x00garbage")
    peer.socket.send_multipart([b"two", b"frames"])
    peer.send(wire.Ping(version=99))
    request_id = peer.submit([1, 2, 3], max_tokens=5)
    peer.wait_until(lambda: request_id in peer.finished, 20)
    assert len(peer.outputs[request_id]) == 5
    assert processes["scheduler"].poll() is None


def test_request_that_can_never_fit_gets_an_error_with_status_400(cluster):
    _, peer, _ = cluster
    request_id = peer.submit([1] * 200, max_tokens=5)
    peer.wait_until(lambda: request_id in peer.finished, 10)
    delta = peer.finished[request_id]
    assert delta.finish_reason == "error" and delta.error_status == 400
    assert "max_model_len" in delta.error


@BOTH_MODES
@pytest.mark.parametrize("how", ["killed", "hung"])
def test_lost_worker_fails_in_flight_requests_and_turns_not_ready(cluster, how):
    env, peer, processes = cluster
    ids = [peer.submit([3, 4, 5], max_tokens=60) for _ in range(3)]  # 3 x 16 blocks: preemptions too
    peer.wait_until(lambda: all(peer.outputs[i] for i in ids), 20)
    worker = processes["worker"]
    worker.send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    elapsed = peer.wait_until(lambda: len(peer.finished) == 3, 10)
    assert elapsed < float(env["BLOCKSERVE_WORKER_TIMEOUT_S"]) + 3
    assert all(peer.finished[i].finish_reason == "error" and peer.finished[i].error_status == 503 for i in ids)
    assert not peer.status().ready
    rejected = peer.submit([1, 2], max_tokens=2)
    peer.wait_until(lambda: rejected in peer.finished, 5)
    assert peer.finished[rejected].error_status == 503
    if how == "hung":
        worker.send_signal(signal.SIGCONT)


def test_a_restarted_worker_is_taken_and_serves(cluster, tmp_path):
    env, peer, processes = cluster
    os.kill(processes["worker"].pid, signal.SIGKILL)
    processes["worker"].wait()
    peer.wait_until(lambda: not peer.status().ready, 10)
    processes["worker"] = start(["-m", "tests.support.fake_worker_process"], env, tmp_path / "worker2.log")
    peer.wait_until(lambda: peer.status().ready, 30)
    request_id = peer.submit([1, 2, 3], max_tokens=4)
    peer.wait_until(lambda: request_id in peer.finished, 20)
    assert len(peer.outputs[request_id]) == 4


def test_worker_drains_on_sigterm_until_the_scheduler_goes(cluster):
    _, peer, processes = cluster
    request_id = peer.submit([1, 2, 3], max_tokens=40)
    peer.wait_until(lambda: peer.outputs[request_id], 20)
    processes["worker"].send_signal(signal.SIGTERM)
    peer.wait_until(lambda: request_id in peer.finished, 20)
    assert peer.finished[request_id].finish_reason == "length" and len(peer.outputs[request_id]) == 40
    assert processes["worker"].poll() is None  # still serving while the scheduler is there
    stop(processes["scheduler"])
    assert processes["worker"].wait(10) == 0


def test_out_of_vocabulary_token_ids_are_rejected_without_harming_other_requests(cluster):
    _, peer, _ = cluster
    healthy = peer.submit([1, 2, 3], max_tokens=10)
    bad = peer.submit([1, 10**6], max_tokens=10)
    peer.wait_until(lambda: healthy in peer.finished and bad in peer.finished, 20)
    assert peer.finished[bad].error_status == 400 and "token ids" in peer.finished[bad].error
    assert peer.finished[healthy].finish_reason == "length" and len(peer.outputs[healthy]) == 10


def test_legacy_mode_ends_a_request_the_decode_table_cannot_hold_at_once(tmp_path):
    env = loopback_env(
        BLOCKSERVE_NUM_KV_BLOCKS="24",
        BLOCKSERVE_BLOCK_SIZE="4",
        ENABLE_V1_KVCACHE_SCHEDULER="0",
        KV_CACHE_RATIO="0.9",  # 21 prefill blocks, 3 decode blocks
        BLOCKSERVE_LEGACY_DEC_BLOCKS="1",
    )
    processes = [
        start(["-m", "service.launch.cli", "scheduler"], env, tmp_path / "scheduler.log"),
        start(["-m", "tests.support.fake_worker_process"], env, tmp_path / "worker.log"),
    ]
    peer = ApiPeer(env["BLOCKSERVE_SCHEDULER_ADDR"])
    try:
        peer.wait_until(lambda: peer.status().ready, 30)
        too_long = peer.submit([4, 5, 6], max_tokens=40)  # 8 decode blocks: more than the table holds
        elapsed = peer.wait_until(lambda: too_long in peer.finished, 10)  # ended alone, inside an empty step
        fits = peer.submit([1, 2, 3], max_tokens=8)
        peer.wait_until(lambda: fits in peer.finished, 10)
        assert elapsed < 5
        assert peer.finished[too_long].error.startswith("incomplete")
        assert peer.finished[fits].finish_reason == "length" and len(peer.outputs[fits]) == 8
        samples = scrape(env["BLOCKSERVE_METRICS_PORT"])  # both reach the finish histograms
        assert samples["blockserve_e2e_request_latency_seconds_count"] == 2
        assert samples["blockserve_request_preemptions_count"] == 2
        pools = {
            s.labels["pool"]: s.value
            for s in metric_samples(env["BLOCKSERVE_METRICS_PORT"], "blockserve_kv_blocks_capacity")
        }
        assert pools == {"prefill": 21, "decode": 3}
    finally:
        peer.close()
        stop_all(processes)
