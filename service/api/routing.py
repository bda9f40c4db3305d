"""Which engine takes a request: exact prefix knowledge and load (`BLOCKSERVE_ROUTING`).

Every engine reports, in band with its deltas, its load and the hashes its prefix cache gains and
evicts (service/contract/block_hashes.py: the scheduler's own chained hash), so the api knows exactly which
leading blocks of a prompt each engine holds. The blocks of a prompt that no engine holds count as
held by the engine it was routed to, from then until its request ends (by then that engine has
reported them), so prompts of a new prefix sent at once follow the first instead of each computing
it on another engine. Routing modes:

- `prefix` (default): the engine of the highest score `matched / prompt_blocks − LOAD_WEIGHT ×
  queue / (mean_queue + 1)`, where `matched` counts the prompt's leading full blocks the engine
  holds (or is computing for this replica) and `queue` is its running plus waiting requests as
  reported, or this replica's own open requests on it if more (reports lag behind a burst); ties go
  to the longer match, then the shorter queue, then the emptier prefix cache (a new prefix goes where
  it evicts least), then round robin. A whole prefix match wins while the holder's queue is up to
  about twice the mean; beyond, the request goes elsewhere.
- `load`: the shortest queue (ties: round robin).
- `round_robin`: each ready engine in turn.

Engines that are not ready, or drain, take nothing.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Literal

from service.contract import wire
from service.contract.block_hashes import extend_block_hashes

RoutingMode = Literal["prefix", "load", "round_robin"]
LOAD_WEIGHT = 1.0


@dataclass(slots=True)
class EngineView:
    """What this replica knows of one engine: its prefix cache and its load."""

    name: str
    block_size: int = 0
    cached_hashes: set[int] = field(default_factory=set)
    routed_hashes: dict[int, int] = field(default_factory=dict)  # block hash -> this replica's open requests with it
    num_queued: int = 0  # running + waiting, as last reported (every replica's)
    num_open_here: int = 0  # this replica's requests on it now
    draining: bool = False

    @property
    def queue(self) -> int:
        return max(self.num_queued, self.num_open_here)

    @property
    def num_held_blocks(self) -> int:
        """The blocks its prefix cache holds, or will once this replica's open requests there are computed."""
        return len(self.cached_hashes) + sum(
            1 for block_hash in self.routed_hashes if block_hash not in self.cached_hashes
        )

    def welcome(self, welcome: wire.ApiWelcome) -> None:
        """The engine's prefix cache as it is now; its reports carry the changes."""
        self.block_size = welcome.block_size
        self.cached_hashes = set(welcome.cached_block_hashes)

    def take(self, report: wire.EngineReport) -> None:
        for block_hash, cached in zip(report.cache_event_hashes, report.cache_events_cached):
            if cached:
                self.cached_hashes.add(block_hash)
            else:
                self.cached_hashes.discard(block_hash)  # the welcome's snapshot may already hold the change
        self.num_queued = report.num_running + report.num_waiting
        self.draining = report.draining

    def num_matched_blocks(self, block_hashes: list[int]) -> int:
        """How many leading blocks of a prompt (its chained hashes) this engine's prefix cache holds, or
        will once the open requests this replica routed here are computed."""
        cached, routed = self.cached_hashes, self.routed_hashes
        for index, block_hash in enumerate(block_hashes):
            if block_hash not in cached and block_hash not in routed:
                return index
        return len(block_hashes)

    def routed(self, block_hashes: list[int]) -> None:
        """A prompt of these blocks goes to this engine: they count as held until `ended(block_hashes)`."""
        for block_hash in block_hashes:
            self.routed_hashes[block_hash] = self.routed_hashes.get(block_hash, 0) + 1

    def ended(self, block_hashes: list[int]) -> None:
        """The request of a routed prompt has ended: the engine's reports say where its blocks are now."""
        for block_hash in block_hashes:
            num_requests = self.routed_hashes.pop(block_hash) - 1
            if num_requests:
                self.routed_hashes[block_hash] = num_requests


@dataclass(frozen=True, slots=True)
class Route:
    engine: EngineView
    reason: str  # prefix (a cached prefix decided), load, or round_robin
    num_matched_blocks: int
    new_block_hashes: list[int] = field(default_factory=list)  # the prompt's full blocks no engine holds


class Router:
    def __init__(self, mode: RoutingMode):
        self.mode = mode
        self._turns = itertools.count()

    def choose(self, engines: list[EngineView], prompt_token_ids: list[int]) -> Route | None:
        """The engine for a prompt among `engines` (ready ones), or None if all of them drain."""
        candidates = [engine for engine in engines if not engine.draining]
        if not candidates:
            return None
        turn = next(self._turns)
        if self.mode == "round_robin":
            return Route(candidates[turn % len(candidates)], "round_robin", 0)
        shortest = min(engine.queue for engine in candidates)
        least_loaded = [engine for engine in candidates if engine.queue == shortest]
        if self.mode == "load":
            return Route(least_loaded[turn % len(least_loaded)], "load", 0)
        block_size = candidates[0].block_size
        block_hashes: list[int] = []
        if block_size:
            extend_block_hashes(block_hashes, prompt_token_ids[: len(prompt_token_ids) - 1], block_size)
        matched = {engine.name: engine.num_matched_blocks(block_hashes) for engine in candidates}
        mean_queue = sum(engine.queue for engine in candidates) / len(candidates)

        def score(engine: EngineView) -> float:
            return matched[engine.name] / max(1, len(block_hashes)) - LOAD_WEIGHT * engine.queue / (mean_queue + 1)

        ranked = {
            engine.name: (score(engine), matched[engine.name], -engine.queue, -engine.num_held_blocks)
            for engine in candidates
        }
        best = max(ranked.values())
        tied = [engine for engine in candidates if ranked[engine.name] == best]
        chosen = tied[turn % len(tied)]
        new_block_hashes = block_hashes[max(matched.values()) :]
        return Route(chosen, "prefix" if matched[chosen.name] else "load", matched[chosen.name], new_block_hashes)
