"""Which engine takes a request: exact prefix knowledge and load (`BLOCKSERVE_ROUTING`).

Every engine reports, in band with its deltas, its load and the hashes its prefix cache gains and
evicts (service/block_hashes.py: the scheduler's own chained hash), so the api knows exactly which
leading blocks of a prompt each engine holds. Routing modes:

- `prefix` (default): the engine of the highest score `matched / prompt_blocks − LOAD_WEIGHT ×
  queue / (mean_queue + 1)`, where `matched` counts the prompt's leading full blocks the engine
  holds and `queue` is its running plus waiting requests as reported, or this replica's own open
  requests on it if more (reports lag behind a burst); ties go to the longer match, then the shorter queue, then round robin. A whole prefix
  match wins while the holder's queue is up to about twice the mean; beyond, the request goes elsewhere.
- `load`: the shortest queue (ties: round robin).
- `round_robin`: each ready engine in turn.

Engines that are not ready, or drain, take nothing.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Literal

from service import wire
from service.block_hashes import extend_block_hashes

RoutingMode = Literal["prefix", "load", "round_robin"]
LOAD_WEIGHT = 1.0


@dataclass(slots=True)
class EngineView:
    """What this replica knows of one engine: its prefix cache and its load."""

    name: str
    block_size: int = 0
    cached_hashes: set[int] = field(default_factory=set)
    num_queued: int = 0  # running + waiting, as last reported (every replica's)
    num_open_here: int = 0  # this replica's requests on it now
    draining: bool = False

    @property
    def queue(self) -> int:
        return max(self.num_queued, self.num_open_here)

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
        """How many leading blocks of a prompt (its chained hashes) this engine's prefix cache holds."""
        cached = self.cached_hashes
        for index, block_hash in enumerate(block_hashes):
            if block_hash not in cached:
                return index
        return len(block_hashes)


@dataclass(frozen=True, slots=True)
class Route:
    engine: EngineView
    reason: str  # prefix (a cached prefix decided), load, or round_robin
    num_matched_blocks: int


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

        ranked = {engine.name: (score(engine), matched[engine.name], -engine.queue) for engine in candidates}
        best = max(ranked.values())
        tied = [engine for engine in candidates if ranked[engine.name] == best]
        chosen = tied[turn % len(tied)]
        return Route(chosen, "prefix" if matched[chosen.name] else "load", matched[chosen.name])
