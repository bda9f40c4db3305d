"""The worker process: a model runner behind a ZMQ DEALER that its own thread serves.

The link thread owns the socket. It says hello (block count, block size, model info, kernels),
answers every ping at once, even while a step computes, and receives and decodes the next steps
while the current one computes, so the runner finds them ready. When it has heard nothing for a
while and owes no step result, it says hello again, so a restarted scheduler finds it. A
malformed frame is counted and dropped. The main thread runs the steps in order and hands each
result to the link thread; with a runner whose steps come in parts (prepare, launch, finish), it
prepares the next step while one computes. On SIGTERM it keeps serving until the scheduler has gone (it drains
its requests first), bounded by `drain_timeout_s`.
"""

from __future__ import annotations

import logging
import queue
import signal
import sys
import threading
import time
import uuid
from typing import Any, Callable, Protocol, runtime_checkable

import zmq
from zmq.utils.monitor import parse_monitor_message

from service.contract import socket_auth, wire
from service.contract.config import Settings
from service.contract.configuration_exit import ConfigurationError

log = logging.getLogger(__name__)

POLL_S = 0.5
REHELLO_AFTER_S = 5.0
CLOSE = b""  # on the results pipe: the link thread stops
# How long the main thread may keep the GIL from the link thread. Python's default (5 ms) held a
# finished step's result back while the main thread built the next step's inputs.
GIL_SWITCH_INTERVAL_S = 0.0001


class Runner(Protocol):
    model_info: wire.ModelInfo
    num_kv_blocks: int
    block_size: int
    kernels: dict[str, str]

    def execute(self, step: wire.SchedulerOutput) -> wire.StepResult: ...


@runtime_checkable
class PipelinedRunner(Runner, Protocol):
    """A runner whose steps come in parts, so the next step's inputs are built while one computes."""

    def prepare(self, step: wire.SchedulerOutput) -> Any: ...  # state and inputs; samples of the step before pending

    def launch(self, prepared: Any) -> Any: ...  # fills those in, starts the compute

    def remaining_s(self, launched: Any) -> float: ...  # how long the compute may still take (0: done)

    def finish(self, launched: Any) -> wire.StepResult: ...  # waits for it, samples


class SchedulerLink:
    """The worker socket, served from one thread; steps come out of `next_step()`, results go in `send()`."""

    def __init__(self, settings: Settings, hello: wire.WorkerHello):
        self.scheduler_connected = False
        self.num_malformed_frames = 0
        self._hello = wire.encode(hello)
        self._steps: queue.SimpleQueue[wire.SchedulerOutput] = queue.SimpleQueue()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, hello.worker_id.encode())
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        # A scheduler silent this long is disconnected; the scheduler gives the worker as long (one setting).
        self._socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(1000 * settings.worker_timeout_s))
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        socket_auth.secure_client(self._socket, socket_auth.client_keys(settings))
        self._socket.connect(settings.worker_addr)
        # The main thread's results reach the link thread over a pipe: a zmq socket is used by one thread.
        pipe_addr = f"inproc://results-{uuid.uuid4().hex}"
        self._results_in = self._context.socket(zmq.PULL)
        self._results_in.bind(pipe_addr)
        self._results_out = self._context.socket(zmq.PUSH)
        self._results_out.connect(pipe_addr)
        self._thread = threading.Thread(target=self._serve, name="scheduler-link", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def next_step(self, timeout_s: float) -> wire.SchedulerOutput | None:
        try:
            return self._steps.get(timeout=timeout_s) if timeout_s > 0 else self._steps.get_nowait()
        except queue.Empty:
            return None

    def send(self, result: wire.StepResult) -> None:
        self._results_out.send(wire.encode(result))

    def close(self) -> None:
        self._results_out.send(CLOSE)
        self._thread.join()
        self._socket.disable_monitor()
        self._context.destroy(linger=0)

    def _serve(self) -> None:
        poller = zmq.Poller()
        for socket in (self._socket, self._monitor, self._results_in):
            poller.register(socket, zmq.POLLIN)
        self._socket.send(self._hello)
        last_heard = time.monotonic()
        num_unanswered = 0  # steps received whose result has not gone out
        while True:
            events = dict(poller.poll(POLL_S * 1000))
            while self._monitor.poll(0):
                event = parse_monitor_message(self._monitor.recv_multipart())["event"]
                self.scheduler_connected = event == zmq.EVENT_CONNECTED
            if self._results_in in events:
                while self._results_in.poll(0):
                    frame = self._results_in.recv()
                    if frame == CLOSE:
                        return
                    self._socket.send(frame)
                    num_unanswered -= 1
                    last_heard = time.monotonic()  # its answer came just now: silence counts from here
            if self._socket in events:
                while self._socket.poll(0):
                    last_heard = time.monotonic()
                    num_unanswered += self._on_frame(self._socket.recv())
            if num_unanswered == 0 and time.monotonic() - last_heard > REHELLO_AFTER_S:
                self._socket.send(self._hello)
                last_heard = time.monotonic()

    def _on_frame(self, frame: bytes) -> int:
        """Handle one frame from the scheduler; 1 if it is a step that needs a result."""
        try:
            message = wire.decode(frame)
            if isinstance(message, wire.SchedulerOutput):
                self._steps.put(message)
                return int(not message.is_empty)
            if not isinstance(message, wire.Ping):
                raise wire.WireError(f"unexpected {type(message).__name__}")
            self._socket.send(wire.encode(wire.Pong()))
        except wire.WireError as exc:
            self.num_malformed_frames += 1
            log.warning("dropped frame #%d: %s", self.num_malformed_frames, exc)
        except Exception:  # no frame may end the link thread (the worker would go deaf)
            self.num_malformed_frames += 1
            log.exception("handling frame #%d failed; dropped it", self.num_malformed_frames)
        return 0


def serve_worker(runner: Runner, settings: Settings) -> None:
    """Serve steps from the scheduler at `settings.worker_addr` until SIGTERM/SIGINT."""
    stop_deadline: float | None = None

    def stop(*_: object) -> None:
        nonlocal stop_deadline
        stop_deadline = time.monotonic() + settings.drain_timeout_s

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    hello = wire.WorkerHello(
        worker_id=f"worker-{uuid.uuid4().hex[:8]}",
        num_kv_blocks=runner.num_kv_blocks,
        block_size=runner.block_size,
        model=runner.model_info,
        kernels=runner.kernels,
    )
    link = SchedulerLink(settings, hello)
    link.start()
    log.info("%s connected to %s with %d KV blocks", hello.worker_id, settings.worker_addr, runner.num_kv_blocks)
    try:
        serving = lambda: stop_deadline is None or (link.scheduler_connected and time.monotonic() < stop_deadline)  # noqa: E731
        if isinstance(runner, PipelinedRunner):
            serve_pipelined(runner, link, serving)
        else:
            serve_serially(runner, link, serving)
    finally:
        link.close()


def serve_serially(runner: Runner, link: SchedulerLink, serving: Callable[[], bool]) -> None:
    """Steps in order, one at a time."""
    while serving():
        step = link.next_step(POLL_S)
        if step is None:
            continue
        started = time.perf_counter()
        result = runner.execute(step)
        if not step.is_empty:
            result.compute_s = time.perf_counter() - started
            link.send(result)


def serve_pipelined(runner: PipelinedRunner, link: SchedulerLink, serving: Callable[[], bool]) -> None:
    """Steps in order, each next one prepared while the one before computes (as vLLM's async
    scheduling does): its deltas taken into state and its inputs built, with the tokens the step
    in flight samples filled in when it has finished. At most one step is prepared ahead."""
    ahead: tuple[wire.SchedulerOutput, Any] | None = None  # (step, prepared)
    while serving():
        if ahead is None:
            step = link.next_step(POLL_S)
            if step is None:
                continue
            ahead = step, runner.prepare(step)
        (step, prepared), ahead = ahead, None
        if step.is_empty:
            continue  # state to drop only: no answer expected
        started = time.perf_counter()
        launched = runner.launch(prepared)
        # The device computes: take the next step in meanwhile.
        if (following := link.next_step(runner.remaining_s(launched))) is not None:
            ahead = following, runner.prepare(following)
        result = runner.finish(launched)
        result.compute_s = time.perf_counter() - started  # what a stream waits between two tokens
        link.send(result)


def run_worker(settings: Settings) -> None:
    """Load the model and serve it. A model or settings this worker cannot serve raise ConfigurationError, saying
    which setting to change: no restart would mend them."""
    from worker.host.cpu_threads import set_thread_defaults

    set_thread_defaults()  # before Paddle and the custom ops load their OpenMP runtimes
    from worker.model_runner import ModelRunner

    try:
        runner = ModelRunner(settings)
    except Exception as exc:
        remedy = _setting_to_change(exc, settings)
        if remedy is None:
            raise
        raise ConfigurationError(f"{exc} ({remedy})") from exc
    serve_worker(runner, settings)


def _setting_to_change(error: Exception, settings: Settings) -> str | None:
    """What to change for an error of loading the model; None for one a restart may mend."""
    from worker.host.placement import PlacementError
    from worker.kernels.op_build import CustomOpsUnavailable
    from worker.layers.precision import PrecisionUnavailable
    from worker.loading.model_file_error import ModelFileError
    from worker.loading.tokenizer import UnsupportedTokenizerError
    from worker.models.config import UnsupportedModelError

    model_errors = UnsupportedModelError, UnsupportedTokenizerError, ModelFileError
    if isinstance(error, (*model_errors, FileNotFoundError, IsADirectoryError, PermissionError)):
        return f"set BLOCKSERVE_MODEL, now {settings.model_path()}, to a readable model this worker supports"
    if isinstance(error, PrecisionUnavailable):
        return "set BLOCKSERVE_DTYPE and BLOCKSERVE_QUANTIZATION to a precision these kernels serve"
    if isinstance(error, PlacementError):
        return "set BLOCKSERVE_DEVICE, or BLOCKSERVE_KV_CACHE_MEMORY or BLOCKSERVE_GPU_MEMORY_UTILIZATION"
    if isinstance(error, CustomOpsUnavailable):
        return "set BLOCKSERVE_KERNELS=auto to serve with pure Paddle where the custom kernels cannot run"
    return None
