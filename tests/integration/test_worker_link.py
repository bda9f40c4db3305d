"""The scheduler-worker link over real sockets: who counts as the worker, and a worker that answers while it computes."""

from __future__ import annotations

import signal
import time

import msgspec
import pytest
import zmq

from service.contract import wire
from service.contract.config import load_settings
from service.scheduler.server import SchedulerServer
from service.tools.fake_worker import FakeWorker
from tests.support.api_peer import ApiPeer
from tests.support.processes import loopback_env, metric_samples, start, stop_all
from tests.support.scripted_worker import BLOCK_SIZE, NUM_BLOCKS, ScriptedWorker
from tests.support.tiny_model import tiny_model_info
from worker.process import PipelinedRunner, serve_worker

MAX_OUTPUT_TOKENS = 90  # 3 prompt tokens + 90 fit the 24 blocks of 4 and the tiny model's context


def link_env(**overrides: str) -> dict[str, str]:
    defaults = {
        "BLOCKSERVE_NUM_KV_BLOCKS": str(NUM_BLOCKS),
        "BLOCKSERVE_BLOCK_SIZE": str(BLOCK_SIZE),
        "BLOCKSERVE_WORKER_TIMEOUT_S": "10",  # the scripted worker answers pings only between its waits
    }
    return loopback_env(**{**defaults, **overrides})


@pytest.fixture
def scripted(tmp_path):
    """Scheduler process + scripted worker + api peer; yields (scheduler process, worker, peer)."""
    env = link_env()
    scheduler = start(["-m", "service.launch.cli", "scheduler"], env, tmp_path / "scheduler.log")
    worker = ScriptedWorker(env["BLOCKSERVE_WORKER_ADDR"])
    peer = ApiPeer(env["BLOCKSERVE_SCHEDULER_ADDR"])
    worker.hello()
    peer.wait_until(lambda: worker.answer() or peer.status().ready, 30)
    yield scheduler, worker, peer
    peer.close()
    worker.close()
    stop_all([scheduler])


def test_a_live_workers_repeated_hello_is_not_taken_as_a_restart(scripted):
    _, worker, peer = scripted
    request_id = peer.submit([1, 2, 3], max_tokens=8)
    peer.wait_until(lambda: worker.answer() or worker.num_steps >= 2, 10)
    worker.hello()  # what a worker says after a silence (a long step, a stalled scheduler)
    peer.wait_until(lambda: worker.answer() or request_id in peer.finished, 10)
    assert peer.finished[request_id].finish_reason == "length", peer.finished[request_id].error
    assert len(peer.outputs[request_id]) == 8
    assert peer.status().num_free_blocks == NUM_BLOCKS  # the same table: nothing rebuilt, nothing leaked


def test_status_names_the_asked_request_ids_the_scheduler_does_not_hold(scripted):
    _, worker, peer = scripted
    held = peer.submit([1, 2, 3], max_tokens=60)
    peer.wait_until(lambda: worker.answer() or bool(peer.outputs[held]), 10)
    seen = len(peer.statuses)
    peer.send(wire.StatusQuery(request_ids=[held, "never-sent"]))
    peer.wait_until(lambda: worker.answer() or len(peer.statuses) > seen, 5)
    assert peer.statuses[-1].unknown_request_ids == ["never-sent"], peer.finished.get(held)
    assert peer.statuses[-1].num_running == 1


def test_another_connection_closing_on_the_worker_socket_leaves_the_worker_registered(tmp_path):
    env = link_env(FAKE_STEP_DELAY_S="0.01")
    processes = [
        start(["-m", "service.launch.cli", "scheduler"], env, tmp_path / "scheduler.log"),
        start(["-m", "tests.support.fake_worker_process"], env, tmp_path / "worker.log"),
    ]
    peer = ApiPeer(env["BLOCKSERVE_SCHEDULER_ADDR"])
    context = zmq.Context()
    try:
        peer.wait_until(lambda: peer.status().ready, 30)
        stray = context.socket(zmq.DEALER)  # a probe, or a worker that gave up before its hello
        monitor = stray.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        stray.connect(env["BLOCKSERVE_WORKER_ADDR"])
        assert monitor.poll(5000), "the stray connection never got through"
        stray.disable_monitor()
        stray.close(linger=0)
        time.sleep(0.5)  # its disconnect event reaches the scheduler
        assert peer.status().ready
        request_id = peer.submit([1, 2, 3], max_tokens=5)
        peer.wait_until(lambda: request_id in peer.finished, 10)
        assert peer.finished[request_id].finish_reason == "length"
    finally:
        context.destroy(linger=0)
        peer.close()
        stop_all(processes)


STEP_S = 2.0


class BusyRunner:
    """A model-free runner in parts, so the worker runs its pipelined loop, whose launch computes in
    Python for STEP_S and so holds the GIL, as the real ModelRunner's forward does on the CPU (the
    interpreter hands it to the link thread only at its switch interval)."""

    def __init__(self):
        self.model_info = tiny_model_info()
        self.kernels: dict[str, str] = {}
        self.num_kv_blocks = NUM_BLOCKS
        self.block_size = BLOCK_SIZE
        self.fake = FakeWorker(NUM_BLOCKS, BLOCK_SIZE, self.model_info.vocab_size)

    def execute(self, step: wire.SchedulerOutput) -> wire.StepResult:
        return self.finish(self.launch(self.prepare(step)))

    def prepare(self, step: wire.SchedulerOutput) -> tuple[int, list[tuple[str, int]]]:
        return step.step_id, self.fake.apply(step)

    def launch(self, prepared: tuple[int, list[tuple[str, int]]]) -> tuple[int, list[tuple[str, int]]]:
        deadline = time.monotonic() + STEP_S
        while time.monotonic() < deadline:
            pass
        return prepared

    @staticmethod
    def remaining_s(launched: tuple[int, list[tuple[str, int]]]) -> float:
        return 0.0  # launch returns with the compute done, as on the CPU

    def finish(self, launched: tuple[int, list[tuple[str, int]]]) -> wire.StepResult:
        return self.fake.compute(*launched)


def serve_busy_worker() -> None:
    """The worker process of the test below: `python -c` runs this."""
    serve_worker(BusyRunner(), load_settings())


def test_the_worker_answers_pings_while_a_step_computes(tmp_path):
    assert isinstance(BusyRunner(), PipelinedRunner)  # the loop the real runner gets
    env = link_env()
    context = zmq.Context()
    scheduler_side = context.socket(zmq.ROUTER)  # the test plays the scheduler
    scheduler_side.setsockopt(zmq.LINGER, 0)
    scheduler_side.bind(env["BLOCKSERVE_WORKER_ADDR"])
    serve = "from tests.integration.test_worker_link import serve_busy_worker; serve_busy_worker()"
    worker = start(["-c", serve], env, tmp_path / "worker.log")
    try:
        assert scheduler_side.poll(30_000), "no hello"
        identity, hello = scheduler_side.recv_multipart()
        assert isinstance(wire.decode(hello), wire.WorkerHello)
        new = wire.NewRequest(
            request_id="r1",
            token_ids=[1, 2, 3],
            num_prompt_tokens=3,
            sampling=wire.SamplingParams(max_tokens=4),
            block_ids=[0],
            num_computed_tokens=0,
            num_scheduled_tokens=3,
        )
        scheduler_side.send_multipart([identity, wire.encode(wire.SchedulerOutput(step_id=1, new_requests=[new]))])
        sent_at = time.monotonic()
        time.sleep(0.3)  # the step is computing now
        pong_s = []
        for _ in range(3):
            pinged_at = time.monotonic()
            scheduler_side.send_multipart([identity, wire.encode(wire.Ping())])
            assert scheduler_side.poll(10_000), "no answer"
            answer = wire.decode(scheduler_side.recv_multipart()[1])
            assert isinstance(answer, wire.Pong), (
                f"{type(answer).__name__} to a ping {pinged_at - sent_at:.2f} s into the step"
            )
            pong_s.append(time.monotonic() - pinged_at)
            time.sleep(0.1)
        assert scheduler_side.poll(10_000), "no step result"
        result = wire.decode(scheduler_side.recv_multipart()[1])
        assert isinstance(result, wire.StepResult) and [token.request_id for token in result.sampled] == ["r1"]
        assert max(pong_s) < STEP_S / 4, pong_s  # each at once, not at the end of the step
    finally:
        context.destroy(linger=0)
        stop_all([worker])


def test_a_worker_whose_results_keep_coming_does_not_starve_the_api_socket(monkeypatch):
    """Each result is answered by the next step, so a fast worker can keep the worker socket full
    for a request's whole life. The scheduler takes turns: with two results and a status query
    waiting, the query is answered before the second result's deltas, not after both.

    In-process over inproc:// sockets, turn by turn: frames sent there are in the scheduler's queues
    when send returns (no I/O thread to race), so the order the test sees is the order it handled them."""
    for name, value in link_env(
        BLOCKSERVE_SCHEDULER_ADDR="inproc://api", BLOCKSERVE_WORKER_ADDR="inproc://worker"
    ).items():
        monkeypatch.setenv(name, value)
    server = SchedulerServer(load_settings())
    worker = ScriptedWorker("inproc://worker", context=server.context)
    peer = ApiPeer("inproc://api", context=server.context)
    try:

        def turn() -> bool:
            server.serve_once(0)
            worker.answer()
            peer.pump(0)
            return False

        worker.hello()
        peer.send(wire.StatusQuery())
        peer.wait_until(lambda: turn() or any(status.ready for status in peer.statuses), 5)
        held = peer.submit([1, 2, 3], max_tokens=60)
        peer.wait_until(lambda: turn() or len(peer.outputs[held]) >= 2, 5)
        server.serve_once(0)  # takes the results just answered and sends the next steps
        steps = worker.hold(2)  # both steps the overlapped loop keeps in flight
        peer.pump(0)  # the deltas of the steps answered before
        for step in steps:
            worker.send_result(step)
        peer.send(wire.StatusQuery(request_ids=[held]))
        arrivals: list[str] = []

        def note(message: wire.Message) -> None:
            if not isinstance(message, wire.DeltaBatch) or message.token_ids or message.deltas:  # not a bare report
                arrivals.append(type(message).__name__)

        peer.on_message = note
        server.serve_once(0)  # all three frames wait in the scheduler's queues
        peer.pump(0)
        assert arrivals.count("DeltaBatch") == 2 and "SchedulerStatus" in arrivals, arrivals
        assert arrivals.index("SchedulerStatus") < 2, arrivals  # before the second result's deltas
        assert peer.statuses[-1].num_running == 1
    finally:
        peer.close()
        worker.close()
        server.close()


# ---------------------------------------------------------------------------- the worker slot


def other_model_hello(worker_id: str) -> wire.WorkerHello:
    """A hello for another model, whose vocabulary of 10 would refuse most prompts were it adopted."""
    model = msgspec.structs.replace(tiny_model_info(), name="EVIL", vocab_size=10, eos_token_ids=[0])
    return wire.WorkerHello(worker_id=worker_id, num_kv_blocks=4, block_size=BLOCK_SIZE, model=model)


def dropped_worker_frames(env: dict[str, str]) -> dict[str, float]:
    samples = metric_samples(env["BLOCKSERVE_METRICS_PORT"], "blockserve_dropped_frames_total")
    return {s.labels["reason"]: s.value for s in samples if s.labels["socket"] == "worker"}


@pytest.fixture
def fake_worker_cluster(tmp_path):
    """Scheduler + model-free worker process (steps of 20 ms) + api peer; yields (env, processes, peer)."""
    env = link_env(FAKE_STEP_DELAY_S="0.02", BLOCKSERVE_WORKER_TIMEOUT_S="3")
    processes = {
        "scheduler": start(["-m", "service.launch.cli", "scheduler"], env, tmp_path / "scheduler.log"),
        "worker": start(["-m", "tests.support.fake_worker_process"], env, tmp_path / "worker.log"),
    }
    peer = ApiPeer(env["BLOCKSERVE_SCHEDULER_ADDR"])
    context = zmq.Context()
    try:
        peer.wait_until(lambda: peer.status(timeout_s=30).ready, 60)
        yield env, processes, peer, context
    finally:
        context.destroy(linger=0)
        peer.close()
        stop_all(list(processes.values()))


def intruder(context: zmq.Context, addr: str) -> zmq.Socket:
    socket = context.socket(zmq.DEALER)
    socket.linger = 0
    socket.connect(addr)
    return socket


def test_a_hello_while_the_worker_lives_is_refused_logged_counted_and_the_stream_goes_on(fake_worker_cluster, tmp_path):
    env, processes, peer, context = fake_worker_cluster
    stream = peer.submit([1, 2, 3], max_tokens=MAX_OUTPUT_TOKENS)
    peer.wait_until(lambda: len(peer.outputs[stream]) >= 2, 10)
    rogue = intruder(context, env["BLOCKSERVE_WORKER_ADDR"])  # kept: a socket collected unsent drops its frame
    rogue.send(wire.encode(other_model_hello("intruder")))
    peer.wait_until(lambda: dropped_worker_frames(env)["slot_taken"] == 1, 10)

    peer.wait_until(lambda: stream in peer.finished, 30)
    assert peer.finished[stream].finish_reason == "length", peer.finished[stream].error
    assert len(peer.outputs[stream]) == MAX_OUTPUT_TOKENS
    status = peer.status()
    assert status.ready and status.num_total_blocks == NUM_BLOCKS  # the live worker's table, not the intruder's
    beyond_ten = peer.submit([50, 60, 70], max_tokens=4)  # token ids the intruder's vocabulary lacks
    peer.wait_until(lambda: beyond_ten in peer.finished, 10)
    assert peer.finished[beyond_ten].finish_reason == "length", peer.finished[beyond_ten].error
    assert "(slot_taken): hello of worker 'intruder' while worker" in (tmp_path / "scheduler.log").read_text()


def test_after_the_worker_died_a_worker_of_another_model_is_refused_and_one_of_its_model_registers(
    fake_worker_cluster, tmp_path
):
    env, processes, peer, context = fake_worker_cluster
    processes["worker"].send_signal(signal.SIGKILL)
    peer.wait_until(lambda: not peer.status().ready, 10)
    rogue = intruder(context, env["BLOCKSERVE_WORKER_ADDR"])  # kept: a socket collected unsent drops its frame
    rogue.send(wire.encode(other_model_hello("other-model-worker")))
    peer.wait_until(lambda: dropped_worker_frames(env)["other_model"] == 1, 10)
    assert peer.status().num_workers == 0  # refused, not adopted

    processes["worker"] = start(["-m", "tests.support.fake_worker_process"], env, tmp_path / "worker2.log")
    peer.wait_until(lambda: peer.status().ready, 60)  # a restarted worker of the model registers as before
    request_id = peer.submit([50, 60, 70], max_tokens=4)
    peer.wait_until(lambda: request_id in peer.finished, 10)
    assert peer.finished[request_id].finish_reason == "length", peer.finished[request_id].error


def test_a_worker_declared_dead_registers_again_under_the_same_identity(fake_worker_cluster):
    env, processes, peer, _ = fake_worker_cluster
    processes["worker"].send_signal(signal.SIGSTOP)
    try:
        peer.wait_until(lambda: not peer.status().ready, 30)  # pings unanswered past the 3 s timeout
    finally:
        processes["worker"].send_signal(signal.SIGCONT)
    peer.wait_until(lambda: peer.status().ready, 30)  # its next hello (same identity) registers it again
    request_id = peer.submit([1, 2, 3], max_tokens=4)
    peer.wait_until(lambda: request_id in peer.finished, 10)
    assert peer.finished[request_id].finish_reason == "length", peer.finished[request_id].error
    assert dropped_worker_frames(env).get("slot_taken", 0) == 0  # its own hello is not another worker's
