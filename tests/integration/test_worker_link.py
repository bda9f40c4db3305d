"""The scheduler-worker link over real sockets: who counts as the worker, and a worker that answers while it computes."""

from __future__ import annotations

import os
import signal
import time

import pytest
import zmq

from gpu_worker.worker_process import PipelinedRunner, serve_worker
from service import wire
from service.config import load_settings
from service.scheduler.fake_worker import FakeWorker
from tests.support.api_peer import ApiPeer
from tests.support.processes import loopback_env, start, stop_all
from tests.support.tiny_model import tiny_model_info

NUM_BLOCKS = 24
BLOCK_SIZE = 4
MAX_OUTPUT_TOKENS = 90  # 3 prompt tokens + 90 fit the 24 blocks of 4 and the tiny model's context


def link_env(**overrides: str) -> dict[str, str]:
    return loopback_env(
        BLOCKSERVE_NUM_KV_BLOCKS=str(NUM_BLOCKS),
        BLOCKSERVE_BLOCK_SIZE=str(BLOCK_SIZE),
        BLOCKSERVE_WORKER_TIMEOUT_S="10",  # the scripted worker answers pings only between its waits
        **overrides,
    )


class ScriptedWorker:
    """A worker played from the test: says hello when told, answers steps (FakeWorker) and pings."""

    def __init__(self, addr: str):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, b"worker-scripted")
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(addr)
        self.fake = FakeWorker(NUM_BLOCKS, BLOCK_SIZE, tiny_model_info().vocab_size)
        self.num_steps = 0

    def hello(self) -> None:
        hello = wire.WorkerHello(
            worker_id="worker-scripted", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, model=tiny_model_info()
        )
        self.socket.send(wire.encode(hello))

    def answer(self) -> bool:
        """Answer every frame that has come; False, so it can sit in a wait_until condition."""
        while self.socket.poll(0):
            message = wire.decode(self.socket.recv())
            if isinstance(message, wire.Ping):
                self.socket.send(wire.encode(wire.Pong()))
            elif isinstance(message, wire.SchedulerOutput):
                result = self.fake.execute(message)
                if not message.is_empty:
                    self.socket.send(wire.encode(result))
                    self.num_steps += 1
        return False

    def hold(self, num_steps: int, timeout_s: float = 5) -> list[wire.SchedulerOutput]:
        """Receive (answering pings) until `num_steps` steps wait here unanswered."""
        held: list[wire.SchedulerOutput] = []
        deadline = time.monotonic() + timeout_s
        while len(held) < num_steps:
            assert self.socket.poll(max(1, int((deadline - time.monotonic()) * 1000))), f"{len(held)} steps came"
            message = wire.decode(self.socket.recv())
            if isinstance(message, wire.Ping):
                self.socket.send(wire.encode(wire.Pong()))
            elif isinstance(message, wire.SchedulerOutput):
                if message.is_empty:
                    self.fake.execute(message)  # state to drop; no answer expected
                else:
                    held.append(message)
        return held

    def send_result(self, step: wire.SchedulerOutput) -> None:
        self.socket.send(wire.encode(self.fake.execute(step)))
        self.num_steps += 1

    def close(self) -> None:
        self.context.destroy(linger=0)


@pytest.fixture
def scripted(tmp_path):
    """Scheduler process + scripted worker + api peer; yields (scheduler process, worker, peer)."""
    env = link_env()
    scheduler = start(["-m", "service.cli", "scheduler"], env, tmp_path / "scheduler.log")
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
        start(["-m", "service.cli", "scheduler"], env, tmp_path / "scheduler.log"),
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


def test_a_worker_whose_results_keep_coming_does_not_starve_the_api_socket(scripted):
    """Each result is answered by the next step, so a fast worker can keep the worker socket full
    for a request's whole life. The scheduler takes turns: with two results and a status query
    waiting, the query is answered before the second result's deltas, not after both."""
    scheduler, worker, peer = scripted
    held = peer.submit([1, 2, 3], max_tokens=60)
    peer.wait_until(lambda: worker.answer() or len(peer.outputs[held]) >= 2, 10)
    steps = worker.hold(2)  # both steps the overlapped loop keeps in flight
    time.sleep(0.2)
    peer.pump(0.05)  # the deltas of the steps answered before
    os.kill(scheduler.pid, signal.SIGSTOP)
    try:
        for step in steps:
            worker.send_result(step)
        peer.send(wire.StatusQuery(request_ids=[held]))
        time.sleep(0.3)  # all three frames wait in the stopped scheduler's sockets
    finally:
        os.kill(scheduler.pid, signal.SIGCONT)
    arrivals: list[str] = []
    peer.on_message = lambda message: arrivals.append(type(message).__name__)
    peer.wait_until(lambda: "SchedulerStatus" in arrivals, 5)
    assert arrivals.index("SchedulerStatus") < 2, arrivals  # before the second result's deltas
    assert peer.statuses[-1].num_running == 1
