"""Every engine an api replica serves from: one connection each, and a router in front of them.

Engines come from `BLOCKSERVE_SCHEDULER_ADDR` (one address, or several separated by commas) or,
with `BLOCKSERVE_ENGINE_DISCOVERY=dns://NAME:PORT` (a headless Service), from the addresses NAME
resolves to, resolved again every `DISCOVERY_INTERVAL_S`: engines that appear are used, engines
that vanish are dropped (their requests end with an error). Each request goes to one engine, chosen
by the router (routing.py) among the engines that are connected, ready and serve the model this
replica serves; a request an engine refused before starting it (not ready, draining) is tried once
more on another. The replica's model is the first engine's (in the order they came) that has named
one, as it last named it: while that engine is down the replica keeps its model and answers 503, so
an engine of another model never takes over (an engine that comes back serving another model changes
it). The replica is ready while an engine of its model is.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from urllib.parse import urlsplit

from service.api.routing import Router, RoutingMode
from service.api.scheduler_client import SchedulerClient, lost_delta
from service.contract import socket_auth, wire

log = logging.getLogger(__name__)

DISCOVERY_INTERVAL_S = 5.0
NO_ENGINE_KNOWN = "no engine is known (none configured, or discovery finds none)"


class NotReady(Exception):
    """No engine of this replica's model can serve now; the message says what is missing."""


def _what_is_missing(status: wire.SchedulerStatus) -> str:
    """Why an engine that answered is not serving this replica."""
    if status.num_workers == 0:
        return "the scheduler answers, but no worker is registered with it"
    if not status.ready:  # a scheduler with a worker is ready unless it drains
        return "the scheduler is draining (shutting down)"
    return "the scheduler has not welcomed this api replica yet"


def configured_addresses(scheduler_addr: str) -> list[str]:
    return [addr.strip() for addr in scheduler_addr.split(",") if addr.strip()]


async def resolve(discovery: str) -> list[str]:
    """The engine addresses a `dns://NAME:PORT` discovery URL stands for now (none if NAME does not resolve)."""
    parts = urlsplit(discovery)
    if parts.scheme != "dns" or not parts.hostname or not parts.port:
        raise ValueError(f"BLOCKSERVE_ENGINE_DISCOVERY must look like dns://NAME:PORT, not {discovery!r}")
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(parts.hostname, parts.port, type=socket.SOCK_STREAM)
    except OSError as exc:
        log.warning("engine discovery: %s does not resolve (%s)", parts.hostname, exc)
        return []
    hosts = sorted({info[4][0] for info in infos})
    return [f"tcp://[{host}]:{parts.port}" if ":" in host else f"tcp://{host}:{parts.port}" for host in hosts]


class EngineSet:
    def __init__(
        self,
        scheduler_addr: str,
        discovery: str,
        routing: RoutingMode,
        replica_id: str,
        *,
        idle_check_s: float,
        on_malformed_frame: Callable[[], None] = lambda: None,
        client_keys: socket_auth.ClientKeys | None = None,
        on_route: Callable[[str, str, int, int], None] = lambda engine, reason, matched, blocks: None,
        on_engines_changed: Callable[[list[str], list[str]], None] = lambda added, dropped: None,
    ) -> None:
        self._scheduler_addr = scheduler_addr
        self._discovery = discovery
        self._replica_id = replica_id
        self._idle_check_s = idle_check_s
        self._on_malformed_frame = on_malformed_frame
        self._client_keys = client_keys
        self._on_route = on_route
        self._on_engines_changed = on_engines_changed
        self.router = Router(routing)
        self.clients: dict[str, SchedulerClient] = {}  # address -> its connection, in the order they came
        self._discovery_task: asyncio.Task[None] | None = None

    @property
    def model(self) -> wire.ModelInfo | None:
        """The model this replica serves: the first engine's that has named one, connected or not."""
        return next((client.model for client in self.clients.values() if client.model), None)

    @property
    def connected(self) -> bool:
        """Whether an engine of this replica's model is connected."""
        model = self.model
        return any(client.connected and client.model == model for client in self.clients.values())

    def serving(self) -> list[SchedulerClient]:
        """The engines a request may go to: connected, ready, and serving this replica's model."""
        model = self.model
        return [c for c in self.clients.values() if c.connected and c.ready and c.model == model]

    async def start(self) -> None:
        if self._discovery:
            await self._use(await resolve(self._discovery))
            self._discovery_task = asyncio.create_task(self._rediscover())
        else:
            await self._use(configured_addresses(self._scheduler_addr))

    async def close(self) -> None:
        if self._discovery_task is not None:
            self._discovery_task.cancel()
            await asyncio.gather(self._discovery_task, return_exceptions=True)
        await asyncio.gather(*(client.close() for client in self.clients.values()))

    async def ready_status(self, timeout_s: float) -> wire.SchedulerStatus:
        """The status of an engine of this replica's model that answers in time that it is ready and has
        welcomed this replica; raises NotReady with what is missing otherwise."""
        clients = list(self.clients.values())
        if not clients:
            raise NotReady(NO_ENGINE_KNOWN)
        answers = await asyncio.gather(*(client.status(timeout_s) for client in clients))
        model = self.model
        # An engine that has not named its model yet (no worker ever) may turn out to serve ours.
        ours = [(c, s) for c, s in zip(clients, answers) if s is not None and c.model in (None, model)]
        for client, status in ours:
            if status.ready and client.connected:
                return status
        if not ours:
            if any(status is not None for status in answers):
                raise NotReady(f"the schedulers that answer serve another model than {model.name}")
            raise NotReady("no scheduler answers")
        missing = [_what_is_missing(status) for _, status in ours]
        raise NotReady("; ".join(dict.fromkeys(missing)))

    def fail_open_requests(self, reason: str) -> None:
        for client in self.clients.values():
            client.fail_open_requests(reason)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: wire.SamplingParams,
        priority: int = 0,
        tenant: str = wire.DEFAULT_TENANT,
        tenant_weight: float = 1.0,
    ) -> AsyncIterator[wire.RequestDelta]:
        """The deltas of one request from the engine the router picks; once more elsewhere if refused."""
        tried: set[str] = set()
        while True:
            candidates = [client for client in self.serving() if client.addr not in tried]
            route = self.router.choose([client.view for client in candidates], prompt_token_ids)
            if route is None:
                yield lost_delta(request_id, self._why_none_serves())
                return
            client = next(client for client in candidates if client.view is route.engine)
            tried.add(client.addr)
            block_size = client.view.block_size
            num_blocks = (len(prompt_token_ids) - 1) // block_size if block_size else 0
            reason = route.reason if len(tried) == 1 else "retry"
            self._on_route(client.addr, reason, route.num_matched_blocks, num_blocks)
            retry = len(tried) == 1 and any(c.addr not in tried for c in self.serving())
            client.view.routed(route.new_block_hashes)
            try:
                generating = client.generate(request_id, prompt_token_ids, sampling, priority, tenant, tenant_weight)
                async with aclosing(generating) as deltas:
                    async for delta in deltas:
                        if retry and delta.refused:
                            break  # refused before it started: another engine may take it
                        retry = False
                        yield delta
                    else:
                        return
            finally:
                client.view.ended(route.new_block_hashes)

    def _why_none_serves(self) -> str:
        if not self.clients:
            return NO_ENGINE_KNOWN
        if not self.connected:
            return "no engine of this replica's model is reachable"
        return "no engine is ready: no worker is available, or the engines are draining"

    async def _use(self, addresses: list[str]) -> None:
        """Connect to engines that are new in `addresses`; drop the ones no longer there."""
        dropped = [addr for addr in self.clients if addr not in addresses]
        added = [addr for addr in dict.fromkeys(addresses) if addr not in self.clients]
        self._on_engines_changed(added, dropped)
        for addr in dropped:
            log.warning("engine %s is gone: its requests end", addr)
            client = self.clients.pop(addr)
            client.fail_open_requests("the engine that had this request is gone")
            await client.close()
        for addr in addresses:
            if addr not in self.clients:
                log.info("engine %s: connecting", addr)
                client = SchedulerClient(
                    addr,
                    self._replica_id,
                    idle_check_s=self._idle_check_s,
                    on_malformed_frame=self._on_malformed_frame,
                    client_keys=self._client_keys,
                )
                self.clients[addr] = client
                await client.start()

    async def _rediscover(self) -> None:
        while True:
            await asyncio.sleep(DISCOVERY_INTERVAL_S)
            addresses = await resolve(self._discovery)
            if addresses or not self.clients:
                await self._use(addresses)
