"""Plays an api replica against a real scheduler process: a DEALER that submits requests as token
ids and collects their deltas (the scheduler-process tests and the step-loop benchmark use it)."""

from __future__ import annotations

import time
import uuid

import zmq

from service.contract import wire


class ApiPeer:
    def __init__(self, addr: str, context: zmq.Context | None = None):
        """`context`: a scheduler's own, to reach its inproc:// sockets (it stays open on close)."""
        self.owns_context = context is None
        self.context = context or zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # a benchmark submits thousands at once
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.connect(addr)
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, wire.RequestDelta] = {}
        self.statuses: list[wire.SchedulerStatus] = []
        self.batch_sizes: list[int] = []  # deltas per DeltaBatch frame
        self.num_tokens = 0
        self.first_token_at = self.last_token_at = 0.0  # perf_counter() times
        self.on_message = lambda message: None  # sees every message, in arrival order

    @property
    def all_finished(self) -> bool:
        return len(self.finished) == len(self.outputs)

    def send(self, message: wire.Message) -> None:
        self.socket.send(wire.encode(message))

    def submit(self, prompt: list[int], max_tokens: int, priority: int = 0, **sampling) -> str:
        request_id = uuid.uuid4().hex
        self.outputs[request_id] = []
        params = wire.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
        self.send(
            wire.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=params, priority=priority)
        )
        return request_id

    def pump(self, timeout_s: float) -> None:
        """Take every message that has come (waiting up to `timeout_s` for the first). Lean: a benchmark's
        scheduler and worker share the machine with it."""
        if not self.socket.poll(int(timeout_s * 1000)):
            return
        while self.socket.poll(0):
            message = wire.decode(self.socket.recv())
            self.on_message(message)
            if isinstance(message, wire.DeltaBatch):
                self.batch_sizes.append(len(message.token_ids) + len(message.deltas))
                self._on_tokens(message.token_request_ids, message.token_ids)
                for delta in message.deltas:
                    self.on_delta(delta)
            elif isinstance(message, wire.RequestDelta):
                self.on_delta(message)
            elif isinstance(message, wire.SchedulerStatus):
                self.statuses.append(message)

    def on_delta(self, delta: wire.RequestDelta) -> None:
        self._on_tokens([delta.request_id] * len(delta.token_ids), delta.token_ids)
        if delta.finish_reason is not None:
            assert delta.request_id not in self.finished, "a delta after the request ended"
            self.finished[delta.request_id] = delta

    def _on_tokens(self, request_ids: list[str], token_ids: list[int]) -> None:
        if not token_ids:
            return
        outputs, finished = self.outputs, self.finished
        for request_id, token_id in zip(request_ids, token_ids):
            assert request_id not in finished, "a token after the request ended"
            outputs[request_id].append(token_id)
        self.num_tokens += len(token_ids)
        self.last_token_at = time.perf_counter()
        self.first_token_at = self.first_token_at or self.last_token_at

    def wait_until(self, condition, timeout_s: float) -> float:
        start_time = time.monotonic()
        while not condition():
            assert time.monotonic() - start_time < timeout_s, "timed out"
            self.pump(0.05)
        return time.monotonic() - start_time

    def status(self, timeout_s: float = 5) -> wire.SchedulerStatus:
        seen = len(self.statuses)
        self.send(wire.StatusQuery())
        self.wait_until(lambda: len(self.statuses) > seen, timeout_s)
        return self.statuses[-1]

    def close(self) -> None:
        if self.owns_context:
            self.context.destroy(linger=0)
        else:
            self.socket.close(linger=0)
