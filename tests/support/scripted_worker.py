"""A worker played from a test over a real socket: says hello when told, answers steps and pings."""

from __future__ import annotations

import time

import zmq

from service.contract import wire
from service.tools.fake_worker import FakeWorker
from tests.support.tiny_model import tiny_model_info

NUM_BLOCKS = 24
BLOCK_SIZE = 4


class ScriptedWorker:
    """A worker played from the test: says hello when told, answers steps (FakeWorker) and pings."""

    def __init__(self, addr: str, context: zmq.Context | None = None):
        self.owns_context = context is None
        self.context = context or zmq.Context()
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
        if self.owns_context:
            self.context.destroy(linger=0)
        else:
            self.socket.close(linger=0)
