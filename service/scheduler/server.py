"""The scheduler process: sockets, frames and liveness around the engine loop (engine.py).

Two ROUTER sockets: api replicas connect to `scheduler_addr` (requests, aborts, status; each
step's deltas go to each replica as one `DeltaBatch`), workers to `worker_addr` (hello, step
results). The worker is pinged every second, computing or not: one that disconnects (its own
connection, matched by fd) or leaves pings unanswered for `worker_timeout_s` is dead, however
long a step takes: readiness turns false and every request ends with an error. The zmq heartbeat
of the worker socket has the same timeout, so one setting decides. A live worker's slot cannot be
taken: another worker's hello is refused until it is dead (its own repeated hello changes
nothing), and the scheduler serves one model for its life, the first worker's, which the api
replicas are told: a worker of another model is refused. An api replica whose connection closes
(or falls silent past API_HEARTBEAT_TIMEOUT_MS) has its requests aborted. A malformed,
unexpected, nonsense or refused frame is dropped and counted in blockserve_dropped_frames_total;
no handler's exception ends the process.
"""

from __future__ import annotations

import gc
import logging
import signal
import time
from collections import deque

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from service.contract import limits, socket_auth, wire
from service.contract.config import Settings
from service.scheduler.counters import SchedulerCounters, TenantLabels
from service.scheduler.engine import EngineLoop
from service.scheduler.metrics import SchedulerMetrics
from service.scheduler.outcome import StepOutcome
from service.scheduler.scheduler import RequestRejected, ScheduledStep, Scheduler

log = logging.getLogger(__name__)

IDLE_POLL_MS = 20
PING_INTERVAL_S = 1.0
API_FRAMES_PER_TURN = 64  # api frames handled between two worker frames (a burst of requests waits its turn)
CLOSE_LINGER_MS = 2000
LAST_DELTAS_GRACE_S = 0.5  # between the shutdown's last deltas and closing the sockets
GC_GEN0_THRESHOLD = 50_000
REPORT_INTERVAL_S = 0.25  # an api replica hears the load at least this often while steps run
MAX_CACHE_EVENTS_PER_REPORT = 4096  # more wait for the next report (in order): frames stay small
ZMQ_HEARTBEAT_IVL_MS = 2000
API_HEARTBEAT_TIMEOUT_MS = 6000  # an api replica silent this long is disconnected: its requests aborted
# A plain (or otherwise broken) peer fails inside libzmq, before ZAP: counted as an auth failure with CURVE on.
HANDSHAKE_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


class DroppedFrame(Exception):
    """A frame the scheduler refuses; `reason` is its label in blockserve_dropped_frames_total."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def source_fd(frame: zmq.Frame) -> int | None:
    """The fd of the connection a frame came on; None over inproc://, which has no connection fd."""
    try:
        return frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return None


class SchedulerServer:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.context = zmq.Context()
        self.curve = socket_auth.CurveServer(
            settings, self.context, lambda socket: self.metrics.auth_failures.labels(socket).inc()
        )
        self.api_socket = self._router(settings.scheduler_addr, API_HEARTBEAT_TIMEOUT_MS)
        self.worker_socket = self._router(settings.worker_addr, int(1000 * settings.worker_timeout_s))
        self.worker_monitor = self.worker_socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILURES)
        self.api_monitor = self.api_socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILURES)
        # connection -> the api replica that sends on it: its fd, or over inproc:// (no fd) its identity
        self.api_fds: dict[int | bytes, bytes] = {}
        self.engine: EngineLoop | None = None
        self.model: wire.ModelInfo | None = None
        self.worker_model: wire.ModelInfo | None = None  # the first worker's, as it said: every later one's must match
        self.worker_id: bytes | None = None
        self.worker_fd: int | None = None  # its connection: a disconnect of any other is not its loss
        self.frame_fd: int | None = None  # the connection of the frame being handled
        # Outlives any one Scheduler, so counters never go back.
        self.counters = SchedulerCounters(tenant_label=TenantLabels(settings.tenant_metrics_limit))
        self.metrics = SchedulerMetrics(
            lambda: self.scheduler, self.counters, lambda: self.model.name if self.model else "", settings.redacted()
        )
        self.step_sent_at: dict[int, float] = {}  # step id -> when it went to the worker, while in flight
        self.step_ended_at: deque[float] = deque()  # when the steps of about the last second returned
        # Cache events the api replicas have not been told yet, in the order the scheduler made them.
        self.cache_event_hashes: list[int] = []
        self.cache_events_cached: list[bool] = []
        self.last_report_at = 0.0
        self.last_ping_at = 0.0
        self.last_heard_at = 0.0
        self.poller = zmq.Poller()
        for socket in (self.api_socket, self.worker_socket, self.worker_monitor, self.api_monitor):
            self.poller.register(socket, zmq.POLLIN)
        self.draining = False
        self.drain_deadline: float | None = None
        self.stopping = False

    def _router(self, addr: str, heartbeat_timeout_ms: int) -> zmq.Socket:
        socket = self.context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a reply to a vanished replica is dropped
        socket.setsockopt(zmq.SNDHWM, 0)  # a ROUTER at its high-water mark drops silently: no limit
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.HEARTBEAT_IVL, ZMQ_HEARTBEAT_IVL_MS)
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, heartbeat_timeout_ms)  # a peer silent this long is disconnected
        self.curve.secure(socket, addr)
        socket.bind(addr)
        return socket

    @property
    def scheduler(self) -> Scheduler | None:
        return self.engine.scheduler if self.engine else None

    @property
    def num_requests(self) -> int:
        return len(self.scheduler.requests) if self.scheduler else 0

    @property
    def ready(self) -> bool:
        return self.worker_id is not None and not self.draining

    # ------------------------------------------------------------------ main loop

    def serve_forever(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.begin_drain())
        signal.signal(signal.SIGINT, lambda *_: self.begin_drain())
        while not self.stopping:
            self.serve_once(IDLE_POLL_MS)
        self.close()

    def serve_once(self, timeout_ms: int) -> None:
        """One turn of the loop: wait up to `timeout_ms` for a frame, handle what came, step if allowed."""
        self.poller.poll(timeout_ms)
        # Connection events before each frame: a closed connection's fd, reused, must not be its successor's.
        self._drain_events()
        self._take_frames()
        now = time.monotonic()
        self._check_worker(now)
        if (failure := self._maybe_step(now)) is not None:
            self._deliver(failure)
        if self.draining:
            self.drain_deadline = self.drain_deadline or now + self.settings.drain_timeout_s
            if self.num_requests == 0 or now >= self.drain_deadline:
                self.stopping = True

    def _take_frames(self) -> None:
        """Handle every frame that has come, taking turns: one worker frame, then up to
        API_FRAMES_PER_TURN api frames. A fast worker's results, each answered by the next step,
        can keep the worker socket full for a whole request's life; the api must not wait for that."""
        while True:
            took = self._poll_once(self.worker_socket, "worker", self._on_worker_frame)
            self._drain_events()
            for _ in range(API_FRAMES_PER_TURN):
                if not self._poll_once(self.api_socket, "api", self._on_api_frame):
                    break
                self._drain_events()
                took = True
            if not took:
                return

    def begin_drain(self) -> None:
        log.info("draining: no new requests; %d in flight", self.num_requests)
        self.draining = True

    def close(self) -> None:
        if self.scheduler is not None and self.scheduler.requests:
            self._deliver(self.scheduler.fail_all("the scheduler is shutting down", time.monotonic()))
            # An api replica's socket drops what it has not read once the connection closes
            # (ZMQ_IMMEDIATE): give it time to read these last deltas first.
            time.sleep(LAST_DELTAS_GRACE_S)
        self.worker_socket.disable_monitor()
        self.api_socket.disable_monitor()
        self.curve.stop()
        self.context.destroy(linger=CLOSE_LINGER_MS)  # let the last deltas of drained requests leave

    def _poll_once(self, socket: zmq.Socket, socket_name: str, handler) -> bool:
        try:
            frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        identity, payload = frames[0].bytes, frames[1:]
        self.frame_fd = source_fd(frames[0])
        try:
            if len(payload) != 1:
                raise DroppedFrame("malformed", f"{len(payload)} payload frames")
            started = time.perf_counter()
            try:
                message = wire.decode(payload[0].buffer)
            except wire.WireError as exc:
                raise DroppedFrame("malformed", str(exc)) from None
            self.metrics.step_loop_seconds["decode"].inc(time.perf_counter() - started)
            handler(identity, message)
        except DroppedFrame as exc:
            self.metrics.dropped_frames.labels(socket_name, exc.reason).inc()
            log.warning("dropped a frame on the %s socket (%s): %s", socket_name, exc.reason, exc)
        except Exception:
            self.metrics.dropped_frames.labels(socket_name, "handler_error").inc()
            log.exception("handling a frame on the %s socket failed; dropped it", socket_name)
        return True

    def _drain_events(self) -> None:
        while self.worker_monitor.poll(0):
            self._on_connection_event("worker", parse_monitor_message(self.worker_monitor.recv_multipart()))
        while self.api_monitor.poll(0):
            self._on_connection_event("api", parse_monitor_message(self.api_monitor.recv_multipart()))

    def _on_connection_event(self, socket_name: str, event: dict) -> None:
        if event["event"] & HANDSHAKE_FAILURES:
            if self.curve.enabled:
                log.warning("refused a %s peer: its handshake failed (no CURVE, or broken)", socket_name)
                self.metrics.auth_failures.labels(socket_name).inc()
        elif socket_name == "worker":
            if self.worker_id is not None and event["value"] == self.worker_fd:
                self._worker_lost("the worker disconnected")
        elif (replica := self.api_fds.pop(event["value"], None)) is not None:
            self._api_replica_lost(replica)

    # ------------------------------------------------------------------ api side

    def _on_api_frame(self, identity: bytes, message: wire.AnyMessage) -> None:
        self.api_fds[identity if self.frame_fd is None else self.frame_fd] = identity
        if isinstance(message, wire.GenerateRequest):
            self._on_generate(identity, message)
        elif isinstance(message, wire.AbortRequest):
            request = self.scheduler.requests.get(message.request_id) if self.scheduler else None
            if request is not None and request.owner == identity:
                self._deliver(self.scheduler.abort_request(message.request_id, time.monotonic()))
        elif isinstance(message, wire.ApiHello):
            if self.model is not None:
                self._send(self.api_socket, identity, self._welcome())
        elif isinstance(message, wire.StatusQuery):
            self._send(self.api_socket, identity, self._status(message.request_ids))
        else:
            raise DroppedFrame("unexpected", f"{type(message).__name__} on the api socket")

    def _welcome(self) -> wire.ApiWelcome:
        """The model, and the prefix cache as it is now (the reports that follow carry its changes)."""
        kv = self.scheduler.kv
        return wire.ApiWelcome(
            model=self.model, ready=self.ready, block_size=kv.block_size, cached_block_hashes=kv.pool.cached_hashes()
        )

    def _api_replica_lost(self, identity: bytes) -> None:
        """Its connection closed: nobody reads its requests' tokens any more; abort them, free their blocks."""
        if self.scheduler is None:
            return
        orphans = [request_id for request_id, request in self.scheduler.requests.items() if request.owner == identity]
        if orphans:
            log.warning("an api replica disconnected: aborting its %d requests", len(orphans))
        now = time.monotonic()
        for request_id in orphans:
            self._deliver(self.scheduler.abort_request(request_id, now))

    def _on_generate(self, identity: bytes, message: wire.GenerateRequest) -> None:
        request_id = message.request_id
        if self.scheduler is None or not self.ready:
            reason = "the service is shutting down" if self.draining else "no worker is available"
            self._send(self.api_socket, identity, self._error_delta(request_id, reason, 503, refused=True))
            return
        now = time.monotonic()
        try:
            self.scheduler.add_request(
                request_id,
                message.prompt_token_ids,
                message.sampling,
                now,
                identity,
                message.priority,
                message.tenant,
                message.tenant_weight,
            )
        except RequestRejected as exc:
            self._send(self.api_socket, identity, self._error_delta(request_id, str(exc), exc.status))

    def _status(self, request_ids: list[str]) -> wire.SchedulerStatus:
        scheduler = self.scheduler
        held = scheduler.requests if scheduler else {}
        return wire.SchedulerStatus(
            ready=self.ready,
            num_workers=int(self.worker_id is not None),
            num_running=len(scheduler.running) if scheduler else 0,
            num_waiting=len(scheduler.waiting) if scheduler else 0,
            num_free_blocks=scheduler.kv.pool.num_free_blocks if scheduler else 0,
            num_total_blocks=scheduler.kv.pool.num_blocks if scheduler else 0,
            unknown_request_ids=[request_id for request_id in request_ids if request_id not in held],
            report=self._report(0),
        )

    def _deliver(self, outcome: StepOutcome) -> None:
        """Send each api replica its deltas in one frame; observe the latencies. When the prefix cache
        changed, or now and then, every replica gets this engine's report (in that frame, or alone)."""
        started = time.perf_counter()
        batches = outcome.batches()
        if self.cache_event_hashes or started - self.last_report_at >= REPORT_INTERVAL_S:
            self.last_report_at = started
            report = self._report(MAX_CACHE_EVENTS_PER_REPORT)
            for replica in set(self.api_fds.values()):
                batches.setdefault(replica, wire.DeltaBatch()).report = report
        for owner, batch in batches.items():
            self._send(self.api_socket, owner, batch)
        try:
            self.metrics.on_outcome(outcome)
        except Exception:  # a latency lost from the metrics must not lose the deltas that follow
            self.metrics.step_loop_errors["metrics"].inc()
            log.exception("observing a step's latencies failed")
        self.metrics.step_loop_seconds["fanout"].inc(time.perf_counter() - started)

    def _keep_cache_events(self, outcome: StepOutcome) -> None:
        """Queue what a scheduler call changed in the prefix cache, in the order of the calls."""
        self.cache_event_hashes += outcome.cache_events[0]
        self.cache_events_cached += outcome.cache_events[1]

    def _report(self, max_cache_events: int) -> wire.EngineReport:
        """The load now, with up to `max_cache_events` of the queued cache events."""
        scheduler = self.scheduler
        hashes, self.cache_event_hashes = (
            self.cache_event_hashes[:max_cache_events],
            self.cache_event_hashes[max_cache_events:],
        )
        cached, self.cache_events_cached = (
            self.cache_events_cached[:max_cache_events],
            self.cache_events_cached[max_cache_events:],
        )
        now = time.monotonic()
        while self.step_ended_at and now - self.step_ended_at[0] > 1.0:
            self.step_ended_at.popleft()
        return wire.EngineReport(
            num_running=len(scheduler.running) if scheduler else 0,
            num_waiting=len(scheduler.waiting) if scheduler else 0,
            num_free_blocks=scheduler.kv.pool.num_free_blocks if scheduler else 0,
            num_total_blocks=scheduler.kv.pool.num_blocks if scheduler else 0,
            steps_per_s=float(len(self.step_ended_at)),
            draining=self.draining,
            cache_event_hashes=hashes,
            cache_events_cached=cached,
        )

    @staticmethod
    def _error_delta(request_id: str, reason: str, status: int, refused: bool = False) -> wire.RequestDelta:
        return wire.RequestDelta(
            request_id=request_id,
            token_ids=[],
            finish_reason="error",
            error=reason,
            error_status=status,
            refused=refused,
        )

    @staticmethod
    def _send(socket: zmq.Socket, identity: bytes, message: wire.Message) -> None:
        socket.send_multipart([identity, wire.encode(message)])

    # ------------------------------------------------------------------ worker side

    def _on_worker_frame(self, identity: bytes, message: wire.AnyMessage) -> None:
        if isinstance(message, wire.WorkerHello):
            self._register_worker(identity, message)
        elif identity != self.worker_id:
            raise DroppedFrame("unknown_worker", f"{type(message).__name__} from an unregistered worker")
        self.worker_fd = self.frame_fd  # a reconnect of the same worker comes on a new connection
        self.last_heard_at = time.monotonic()
        if isinstance(message, wire.StepResult):
            self._on_step_result(message)
        elif not isinstance(message, (wire.Pong, wire.WorkerHello)):
            raise DroppedFrame("unexpected", f"{type(message).__name__} on the worker socket")

    def _register_worker(self, identity: bytes, hello: wire.WorkerHello) -> None:
        if problem := limits.hello_problem(hello):
            raise DroppedFrame("invalid", f"worker hello: {problem}")
        if identity == self.worker_id:
            if hello.block_size != self.scheduler.config.block_size:
                raise DroppedFrame("invalid", f"worker hello: block_size {hello.block_size} disagrees with the table")
            return  # the live worker repeats its hello after a silence: nothing restarted
        if self.worker_id is not None:
            raise DroppedFrame(
                "slot_taken",
                f"hello of worker {hello.worker_id!r} while worker {self.worker_id.decode(errors='replace')!r} is alive",
            )
        if self.worker_model is not None and hello.model != self.worker_model:
            raise DroppedFrame(
                "other_model",
                f"worker {hello.worker_id!r} serves model {hello.model.name!r}, not {self.worker_model.name!r}, which "
                "the api replicas were told (restart the scheduler to serve another model)",
            )
        self.engine = EngineLoop.for_worker(self.settings, hello, self.counters)
        config = self.engine.scheduler.config
        self.worker_model = hello.model
        self.model = msgspec.structs.replace(hello.model, max_model_len=config.max_model_len)
        self.metrics.start_series(self.model.name)
        self.metrics.add_settings_info({f"worker_{key}": value for key, value in hello.kernels.items()})
        self.worker_id = identity
        self.last_ping_at = self.last_heard_at = time.monotonic()
        log.info(
            "worker %s registered: %d KV blocks of %d tokens, model %s",
            hello.worker_id,
            config.num_blocks,
            hello.block_size,
            hello.model.name,
        )
        # Api replicas that said hello before the first worker came are waiting for their welcome.
        for replica in set(self.api_fds.values()):
            self._send(self.api_socket, replica, self._welcome())

    def _on_step_result(self, result: wire.StepResult) -> None:
        now = time.monotonic()
        started = time.perf_counter()
        try:
            outcome = self.engine.complete(result, now) if self.engine else None
        except Exception:
            self._deliver(self._step_loop_failed("update"))
            return
        self.metrics.step_loop_seconds["update"].inc(time.perf_counter() - started)
        if outcome is None:
            raise DroppedFrame("unexpected", f"a result for step {result.step_id}, which is not the oldest in flight")
        self._keep_cache_events(outcome)
        self.step_ended_at.append(now)
        self.metrics.on_step(now - self.step_sent_at.pop(result.step_id))
        if result.num_constrained:
            self.metrics.on_grammar_masks(result)
        failure = self._maybe_step(now)  # the next step first: the worker must not wait for the fan-out
        self._deliver(outcome)
        if failure is not None:  # its closing deltas follow the tokens the step gave
            self._deliver(failure)

    def _maybe_step(self, now: float) -> StepOutcome | None:
        """Schedule and send steps while the engine loop allows (serial: one in flight; overlapped: two).
        Returns what a failure of the core ended, for the caller to deliver after what it holds."""
        if self.worker_id is not None and self.engine is not None:
            try:
                self.engine.run(now, self._send_step)
            except Exception:
                return self._step_loop_failed("schedule")
        return None

    def _step_loop_failed(self, part: str) -> StepOutcome:
        """An unexpected error inside the scheduler core: its requests' state can no longer be trusted, so
        each ends with an error (500, blocks freed, the worker told) and the loop serves on. Exiting would
        fail them all the same, and a restart would forget what the table has learned."""
        self.metrics.step_loop_errors[part].inc()
        log.exception("the scheduler core failed (%s): ending its %d requests", part, self.num_requests)
        self.step_sent_at.clear()
        return self.engine.fail("internal error in the scheduler", time.monotonic(), error_status=500)

    def _send_step(self, step: ScheduledStep) -> None:
        self.metrics.step_loop_seconds["schedule"].inc(step.schedule_s)
        self._keep_cache_events(step.outcome)
        output = step.output
        if not output.is_empty or output.finished_request_ids or output.preempted_request_ids or output.reset:
            started = time.perf_counter()
            self._send(self.worker_socket, self.worker_id, output)
            self.metrics.step_loop_seconds["encode"].inc(time.perf_counter() - started)
        self._deliver(step.outcome)
        if step.needs_result:
            self.step_sent_at[step.step_id] = time.monotonic()
            self.metrics.on_schedule(output.num_scheduled_tokens, step.schedule_s)

    def _check_worker(self, now: float) -> None:
        """Ping while steps compute too: a long step is answered by pongs, a hung or dead worker is not."""
        if self.worker_id is None:
            return
        if self.last_ping_at - self.last_heard_at > self.settings.worker_timeout_s:
            self._worker_lost(f"the worker did not answer pings for {self.settings.worker_timeout_s:.0f} s")
        elif now - self.last_ping_at > PING_INTERVAL_S:
            self._send(self.worker_socket, self.worker_id, wire.Ping())
            self.last_ping_at = now

    def _worker_lost(self, reason: str) -> None:
        log.error("%s: failing %d requests", reason, self.num_requests)
        self.worker_id = None
        self.step_sent_at.clear()
        if self.engine is not None:
            self._deliver(self.engine.fail(reason, time.monotonic()))


def run_scheduler(settings: Settings) -> None:
    server = SchedulerServer(settings)
    server.metrics.serve(settings.host, settings.metrics_port)
    log.info(
        "scheduler listening: api %s, workers %s, metrics on %s:%d/metrics",
        settings.scheduler_addr,
        settings.worker_addr,
        settings.host,
        settings.metrics_port,
    )
    # Every request's state lives for many steps: the default gen-0 threshold (700 allocations) makes
    # the collector walk them several times a step. Move start-up objects out of its sight and
    # collect young objects less often.
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, 20, 100)
    server.serve_forever()
