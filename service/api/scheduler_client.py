"""The api replica's one connection to the scheduler: a ZMQ DEALER shared by all requests.

A reader task routes each delta (one DeltaBatch per scheduler step, or a lone RequestDelta)
to the queue of its request. Requests never hang on a lost scheduler: when the connection drops,
every open request ends with an error delta; when a request hears nothing for `idle_check_s`, a
status query lists this replica's open request ids, and the request ends with an error delta if
the scheduler does not answer or answers that it does not hold it (whatever else it holds).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from service.api.routing import EngineView
from service.contract import socket_auth, wire

log = logging.getLogger(__name__)

HELLO_RETRY_S = 1.0
STATUS_TIMEOUT_S = 2.0
HEARTBEAT_IVL_MS = 2000
HEARTBEAT_TIMEOUT_MS = 6000


def lost_delta(request_id: str, reason: str) -> wire.RequestDelta:
    """The last delta of a request whose scheduler is gone."""
    return wire.RequestDelta(request_id=request_id, token_ids=[], finish_reason="error", error=reason, error_status=503)


class SchedulerClient:
    """Submits requests, streams their deltas, aborts, asks for status."""

    def __init__(
        self,
        addr: str,
        replica_id: str,
        *,
        idle_check_s: float,
        on_malformed_frame: Callable[[], None] = lambda: None,
        client_keys: socket_auth.ClientKeys | None = None,
    ) -> None:
        self.addr = addr
        self.replica_id = replica_id
        self.model: wire.ModelInfo | None = None  # the last welcome's; kept across reconnects
        self.ready = False  # as the last welcome or status said
        self.view = EngineView(addr)  # its prefix cache and load, for the router
        self._idle_check_s = idle_check_s
        self._on_malformed_frame = on_malformed_frame
        self._client_keys = client_keys
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._welcomed = asyncio.Event()  # welcomed on the current connection
        self._streams: dict[str, asyncio.Queue[wire.RequestDelta]] = {}
        self._status_waiters: list[asyncio.Future[wire.SchedulerStatus]] = []
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def connected(self) -> bool:
        return self._welcomed.is_set()

    async def start(self) -> None:
        socket = self._socket
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IMMEDIATE, 1)  # nothing queues for a scheduler that is not there
        socket.setsockopt(zmq.SNDHWM, 0)  # no silent drops: in-flight HTTP requests bound the queues
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        socket_auth.secure_client(socket, self._client_keys)
        socket.connect(self.addr)
        self._tasks = [
            asyncio.create_task(self._read_loop()),
            asyncio.create_task(self._watch_connection(monitor)),
            asyncio.create_task(self._greet_loop()),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.fail_open_requests("the api is shutting down")
        self._socket.disable_monitor()
        self._context.destroy(linger=0)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: wire.SamplingParams,
        priority: int = 0,
        tenant: str = wire.DEFAULT_TENANT,
        tenant_weight: float = 1.0,
    ) -> AsyncIterator[wire.RequestDelta]:
        """The deltas of one request; leaving early (or being cancelled) aborts it."""
        queue: asyncio.Queue[wire.RequestDelta] = asyncio.Queue()
        self._streams[request_id] = queue
        self.view.num_open_here = len(self._streams)
        finished = False
        try:
            request = wire.GenerateRequest(
                request_id=request_id,
                prompt_token_ids=prompt_token_ids,
                sampling=sampling,
                priority=priority,
                tenant=tenant,
                tenant_weight=tenant_weight,
            )
            if not self._send(request):
                finished = True
                yield lost_delta(request_id, "the scheduler is not reachable")
                return
            while not finished:
                delta = await self._next_delta(request_id, queue)
                finished = delta.finish_reason is not None
                yield delta
        finally:
            del self._streams[request_id]
            self.view.num_open_here = len(self._streams)
            if not finished:
                self._send(wire.AbortRequest(request_id=request_id))

    async def status(self, timeout_s: float = STATUS_TIMEOUT_S) -> wire.SchedulerStatus | None:
        """The scheduler's status, or None if it does not answer in time.

        The query carries every open request id, so any answer says which of them the scheduler lost.
        """
        waiter: asyncio.Future[wire.SchedulerStatus] = asyncio.get_running_loop().create_future()
        self._status_waiters.append(waiter)
        try:
            if not self._send(wire.StatusQuery(request_ids=list(self._streams))):
                return None
            return await asyncio.wait_for(waiter, timeout_s)
        except asyncio.TimeoutError:
            return None
        finally:
            if waiter in self._status_waiters:
                self._status_waiters.remove(waiter)

    async def _next_delta(self, request_id: str, queue: asyncio.Queue[wire.RequestDelta]) -> wire.RequestDelta:
        while True:
            try:
                return await asyncio.wait_for(queue.get(), self._idle_check_s)
            except asyncio.TimeoutError:
                # Silence is fine while the request waits its turn, as long as the scheduler has it.
                if not queue.empty():
                    continue
                status = await self.status()
                if status is None:
                    return lost_delta(request_id, "the scheduler stopped answering")
                # Deltas sent before the answer are queued by now: the last one may have come meanwhile.
                if queue.empty() and request_id in status.unknown_request_ids:
                    return lost_delta(request_id, "the scheduler no longer has this request")

    def _send(self, message: wire.Message) -> bool:
        """Send without waiting; False when no scheduler is connected to take it."""
        sent = self._socket.send(wire.encode(message), zmq.NOBLOCK)
        error = sent.exception()  # NOBLOCK sends complete at once
        if error is not None:
            log.debug("could not send %s: %s", type(message).__name__, error)
        return error is None

    async def _read_loop(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            try:
                if len(frames) != 1:
                    raise wire.WireError(f"{len(frames)} frames in one message")
                self._dispatch(wire.decode(frames[0]))
            except wire.WireError as exc:
                self._on_malformed_frame()
                log.warning("dropped a frame from the scheduler: %s", exc)
            except Exception:  # no frame may end the reader: every stream of this replica would hang
                self._on_malformed_frame()
                log.exception("handling a frame from the scheduler failed; dropped it")

    def _dispatch(self, message: wire.AnyMessage) -> None:
        if isinstance(message, wire.DeltaBatch):
            if message.report is not None:
                self.view.take(message.report)
            for delta in message.all_deltas():
                self._route(delta)
        elif isinstance(message, wire.RequestDelta):
            self._route(message)
        elif isinstance(message, wire.SchedulerStatus):
            self.ready = message.ready
            if message.report is not None:
                self.view.take(message.report)
            waiters, self._status_waiters = self._status_waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(message)
        elif isinstance(message, wire.ApiWelcome):
            if self.model != message.model:
                log.info("serving model %s (max_model_len %d)", message.model.name, message.model.max_model_len)
            self.model = message.model
            self.ready = message.ready
            self.view.welcome(message)
            self._welcomed.set()
        else:
            raise wire.WireError(f"unexpected {type(message).__name__} on the api socket")

    def _route(self, delta: wire.RequestDelta) -> None:
        queue = self._streams.get(delta.request_id)
        if queue is not None:
            queue.put_nowait(delta)

    async def _greet_loop(self) -> None:
        """Say hello until welcomed; a new connection also says hello at once (see below)."""
        while True:
            if not self._welcomed.is_set():
                self._send(wire.ApiHello(replica_id=self.replica_id))
            await asyncio.sleep(HELLO_RETRY_S)

    async def _watch_connection(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._send(wire.ApiHello(replica_id=self.replica_id))
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                log.warning("lost the connection to the scheduler at %s", self.addr)
                self._welcomed.clear()
                self.fail_open_requests("the connection to the scheduler was lost")

    def fail_open_requests(self, reason: str) -> None:
        """End every open request with an error delta (a stream then ends with an error event)."""
        for request_id, queue in self._streams.items():
            queue.put_nowait(lost_delta(request_id, reason))
