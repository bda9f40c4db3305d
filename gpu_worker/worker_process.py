"""The worker process: a ZMQ DEALER loop around a model runner.

It says hello (block count, block size, model info), then answers every step with a
StepResult and every ping with a pong. If it hears nothing for a while it says hello again,
so a restarted scheduler finds it. A malformed frame is counted and dropped. On SIGTERM it
keeps serving until the scheduler has gone (it drains its requests first), bounded by
`drain_timeout_s`.
"""

from __future__ import annotations

import logging
import signal
import time
import uuid
from typing import Protocol

import zmq
from zmq.utils.monitor import parse_monitor_message

from service import wire
from service.config import Settings

log = logging.getLogger(__name__)

POLL_MS = 500
REHELLO_AFTER_S = 5.0


class Runner(Protocol):
    model_info: wire.ModelInfo
    num_kv_blocks: int
    block_size: int

    def execute(self, step: wire.SchedulerOutput) -> wire.StepResult: ...


def serve_worker(runner: Runner, settings: Settings) -> None:
    """Serve steps from the scheduler at `settings.worker_addr` until SIGTERM/SIGINT."""
    stop_deadline: float | None = None

    def stop(*_: object) -> None:
        nonlocal stop_deadline
        stop_deadline = time.monotonic() + settings.drain_timeout_s

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    worker_id = f"worker-{uuid.uuid4().hex[:8]}"
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, worker_id.encode())
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.HEARTBEAT_IVL, 2000)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, 6000)
    monitor = socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    socket.connect(settings.worker_addr)
    scheduler_connected = False
    hello = wire.encode(
        wire.WorkerHello(
            worker_id=worker_id,
            num_kv_blocks=runner.num_kv_blocks,
            block_size=runner.block_size,
            model=runner.model_info,
        )
    )
    socket.send(hello)
    log.info("%s connected to %s with %d KV blocks", worker_id, settings.worker_addr, runner.num_kv_blocks)
    last_heard = time.monotonic()
    num_malformed = 0
    try:
        while stop_deadline is None or (scheduler_connected and time.monotonic() < stop_deadline):
            while monitor.poll(0):
                scheduler_connected = parse_monitor_message(monitor.recv_multipart())["event"] == zmq.EVENT_CONNECTED
            if not socket.poll(POLL_MS):
                if time.monotonic() - last_heard > REHELLO_AFTER_S:
                    socket.send(hello)
                    last_heard = time.monotonic()
                continue
            last_heard = time.monotonic()
            try:
                message = wire.decode(socket.recv())
            except wire.WireError as exc:
                num_malformed += 1
                log.warning("dropped malformed frame #%d: %s", num_malformed, exc)
                continue
            if isinstance(message, wire.SchedulerOutput):
                result = runner.execute(message)
                if not message.is_empty:
                    socket.send(wire.encode(result))
            elif isinstance(message, wire.Ping):
                socket.send(wire.encode(wire.Pong()))
            else:
                num_malformed += 1
                log.warning("dropped unexpected %s", type(message).__name__)
    finally:
        socket.disable_monitor()
        context.destroy(linger=0)


def run_worker(settings: Settings) -> None:
    from gpu_worker.model_runner import ModelRunner

    serve_worker(ModelRunner(settings), settings)
