"""A scripted stand-in for the scheduler, and an api server to put in front of it.

`FakeScheduler` binds a ROUTER on a free loopback port and answers from a background thread:
ApiHello with the tiny model's ModelInfo (tiny_model.py), StatusQuery with
`ready` and the asked request ids it does not hold, and GenerateRequest with the tokens of
`reply_text`, one delta per token (finish "length" at max_tokens, else the EOS token and finish
"stop"; or `error`, after `error_after_tokens` tokens), the deltas due at one moment in one DeltaBatch per replica, as the scheduler sends a
step's. It records every request and abort. `ApiServer` runs the real app under a real uvicorn server on a free loopback port.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import uvicorn
import zmq

from service.api import create_app
from service.contract import wire
from service.contract.config import Settings
from tests.support.tiny_model import EOS_TOKEN_ID, tiny_model_info, tiny_tokenizer


@dataclass
class _Outgoing:
    due_s: float
    identity: bytes
    delta: wire.RequestDelta


class FakeScheduler:
    """Set the public attributes to script the next answers; read the recorded lists."""

    def __init__(self, addr: str = "tcp://127.0.0.1:*", model: wire.ModelInfo | None = None) -> None:
        self.reply_text = "Hello world"
        self.ready = True
        self.silent = False  # ignore everything, like a wedged scheduler
        self.lose_requests = False  # accept generate requests, then never answer them
        self.num_other_requests = 0  # requests of other replicas it says it runs
        self.error: tuple[int, str] | None = None  # answer generate with this (status, message)
        self.error_after_tokens = 0  # ... after this many tokens of the reply
        self.token_delay_s = 0.0
        self.generated: list[wire.GenerateRequest] = []
        self.aborted: list[str] = []
        self.replicas: dict[bytes, str] = {}
        self._tokenizer = tiny_tokenizer()
        self._model = tiny_model_info() if model is None else model
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(addr)
        self.addr = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._raw_frames: queue.Queue[bytes] = queue.Queue()
        self._outgoing: list[_Outgoing] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fake-scheduler", daemon=True)

    def __enter__(self) -> FakeScheduler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Close the socket, as if the scheduler process died."""
        self._stopping.set()
        self._thread.join(timeout=5)

    def send_raw(self, frame: bytes) -> None:
        """Send `frame` as is to every replica that said hello."""
        self._raw_frames.put(frame)

    def reply_tokens(self) -> list[int]:
        return self._tokenizer.encode(self.reply_text, add_special_tokens=False).ids

    def _serve(self) -> None:
        try:
            while not self._stopping.is_set():
                if self._socket.poll(5):
                    identity, frame = self._socket.recv_multipart()
                    if not self.silent:
                        self._handle(identity, wire.decode(frame))
                while not self._raw_frames.empty():
                    frame = self._raw_frames.get()
                    for identity in self.replicas:
                        self._socket.send_multipart([identity, frame])
                self._send_due()
        finally:
            self._context.destroy(linger=0)

    def _handle(self, identity: bytes, message: wire.AnyMessage) -> None:
        if isinstance(message, wire.ApiHello):
            self.replicas[identity] = message.replica_id
            self._socket.send_multipart([identity, wire.encode(wire.ApiWelcome(model=self._model, ready=self.ready))])
        elif isinstance(message, wire.StatusQuery):
            held = {out.delta.request_id for out in self._outgoing}
            status = wire.SchedulerStatus(
                ready=self.ready,
                num_workers=1,
                num_running=len(held) + self.num_other_requests,
                num_waiting=0,
                num_free_blocks=8,
                num_total_blocks=8,
                unknown_request_ids=[request_id for request_id in message.request_ids if request_id not in held],
            )
            self._socket.send_multipart([identity, wire.encode(status)])
        elif isinstance(message, wire.AbortRequest):
            self.aborted.append(message.request_id)
            self._outgoing = [out for out in self._outgoing if out.delta.request_id != message.request_id]
        elif isinstance(message, wire.GenerateRequest):
            self.generated.append(message)
            if self.lose_requests:
                return
            for delay_index, delta in enumerate(self._script(message), start=1):
                due_s = time.monotonic() + delay_index * self.token_delay_s
                self._outgoing.append(_Outgoing(due_s, identity, delta))

    def _script(self, request: wire.GenerateRequest) -> list[wire.RequestDelta]:
        num_prompt_tokens = len(request.prompt_token_ids)
        if self.error is not None:
            status, message = self.error
            tokens = [
                wire.RequestDelta(request_id=request.request_id, token_ids=[token_id])
                for token_id in self.reply_tokens()[: self.error_after_tokens]
            ]
            return tokens + [
                wire.RequestDelta(
                    request_id=request.request_id,
                    token_ids=[],
                    finish_reason="error",
                    error=message,
                    error_status=status,
                    num_prompt_tokens=num_prompt_tokens,
                )
            ]
        token_ids = [*self.reply_tokens(), EOS_TOKEN_ID]
        max_tokens = request.sampling.max_tokens
        finish_reason = "length" if len(token_ids) > max_tokens else "stop"
        token_ids = token_ids[:max_tokens]
        top_k = request.sampling.logprobs
        deltas = []
        for position, token_id in enumerate(token_ids):
            logprob = -0.25 * (position + 1)
            top = None
            if top_k is not None:
                others = [other for other in range(10, 10 + top_k + 1) if other != token_id]
                ranked = [token_id, *others][:top_k]
                top = [[wire.TokenLogprob(ranked_id, logprob - rank) for rank, ranked_id in enumerate(ranked)]]
            deltas.append(
                wire.RequestDelta(
                    request_id=request.request_id,
                    token_ids=[token_id],
                    logprobs=None if top_k is None else [logprob],
                    top_logprobs=top,
                    finish_reason=finish_reason if position == len(token_ids) - 1 else None,
                    num_prompt_tokens=num_prompt_tokens,
                )
            )
        return deltas

    def _send_due(self) -> None:
        now_s = time.monotonic()
        due = [out for out in self._outgoing if out.due_s <= now_s]
        self._outgoing = [out for out in self._outgoing if out.due_s > now_s]
        batches: dict[bytes, list[wire.RequestDelta]] = {}
        for out in due:
            batches.setdefault(out.identity, []).append(out.delta)
        for identity, deltas in batches.items():
            self._socket.send_multipart([identity, wire.encode(wire.DeltaBatch(deltas=deltas))])


class ApiServer:
    """The real app under uvicorn, on a free loopback port, in a background thread."""

    def __init__(self, scheduler_addr: str, **settings: object) -> None:
        settings.setdefault("api_key", None)
        self.settings = Settings(scheduler_addr=scheduler_addr, **settings)
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        host, port = self._socket.getsockname()
        self.base_url = f"http://{host}:{port}"
        config = uvicorn.Config(create_app(self.settings), log_level="warning", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    def __enter__(self) -> ApiServer:
        self._thread.start()
        wait_until(lambda: self._server.started, timeout_s=10)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()

    def wait_ready(self, timeout_s: float = 10) -> None:
        wait_until(lambda: httpx.get(f"{self.base_url}/ready").status_code == 200, timeout_s=timeout_s)


def free_tcp_addr() -> str:
    """A loopback address nothing listens on (yet)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


def wait_until(condition, timeout_s: float = 5.0, interval_s: float = 0.02) -> None:
    """Poll `condition` until it is true; fail the test if it never is."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(interval_s)
