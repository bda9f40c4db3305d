"""Plays an api replica against a real scheduler process: a DEALER that submits requests as token
ids and collects their deltas (the scheduler-process tests and the step-loop benchmark use it)."""

from __future__ import annotations

import time
import uuid

import zmq

from service import wire


class ApiPeer:
    def __init__(self, addr: str):
        self.context = zmq.Context()
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
    def open_request_ids(self) -> set[str]:
        return self.outputs.keys() - self.finished.keys()

    def send(self, message: wire.Message) -> None:
        self.socket.send(wire.encode(message))

    def submit(self, prompt: list[int], max_tokens: int, **sampling) -> str:
        request_id = uuid.uuid4().hex
        self.outputs[request_id] = []
        params = wire.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
        self.send(wire.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=params))
        return request_id

    def pump(self, timeout_s: float) -> None:
        if not self.socket.poll(int(timeout_s * 1000)):
            return
        while self.socket.poll(0):
            message = wire.decode(self.socket.recv())
            self.on_message(message)
            if isinstance(message, wire.DeltaBatch):
                deltas = message.all_deltas()
                self.batch_sizes.append(len(deltas))
                for delta in deltas:
                    self.on_delta(delta)
            elif isinstance(message, wire.RequestDelta):
                self.on_delta(message)
            elif isinstance(message, wire.SchedulerStatus):
                self.statuses.append(message)

    def on_delta(self, delta: wire.RequestDelta) -> None:
        assert delta.request_id not in self.finished, "a delta after the request ended"
        self.outputs[delta.request_id].extend(delta.token_ids)
        if delta.token_ids:
            self.num_tokens += len(delta.token_ids)
            self.last_token_at = time.perf_counter()
            self.first_token_at = self.first_token_at or self.last_token_at
        if delta.finish_reason is not None:
            self.finished[delta.request_id] = delta

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
        self.context.destroy(linger=0)
