"""The api's router: exact prefix knowledge from engine reports, and load."""

from __future__ import annotations

import pytest

from service.api.routing import EngineView, Router
from service.contract import wire
from service.contract.block_hashes import extend_block_hashes

BLOCK = 4


def hashes(token_ids: list[int]) -> list[int]:
    block_hashes: list[int] = []
    extend_block_hashes(block_hashes, token_ids, BLOCK)
    return block_hashes


def engine(name: str, cached_prompt: list[int] = (), queue: int = 0) -> EngineView:
    view = EngineView(name)
    view.welcome(
        wire.ApiWelcome(model=None, ready=True, block_size=BLOCK, cached_block_hashes=hashes(list(cached_prompt)))
    )
    view.num_queued = queue
    return view


SYSTEM = list(range(100, 116))  # four full blocks


def test_welcome_and_reports_keep_the_engines_cache_in_order():
    view = engine("a")
    first, second = hashes([1, 2, 3, 4, 5, 6, 7, 8])
    report = wire.EngineReport(
        num_running=2, num_waiting=1, num_free_blocks=0, num_total_blocks=8, steps_per_s=10.0,
        cache_event_hashes=[first, second, first, first], cache_events_cached=[True, True, False, True],
    )  # fmt: skip
    view.num_open_here = 5
    view.take(report)
    assert view.cached_hashes == {first, second} and view.queue == 5  # its own open requests, the report lags
    view.num_open_here = 1
    assert view.queue == 3
    view.take(wire.EngineReport(0, 0, 0, 8, 0.0, cache_event_hashes=[second], cache_events_cached=[False]))
    view.take(wire.EngineReport(0, 0, 0, 8, 0.0, cache_event_hashes=[second], cache_events_cached=[False]))
    assert view.cached_hashes == {first}  # an eviction the snapshot already had changes nothing


def test_matched_blocks_are_the_leading_run_only():
    view = engine("a", SYSTEM)
    assert view.num_matched_blocks(hashes(SYSTEM + [1, 2, 3, 4])) == 4
    assert view.num_matched_blocks(hashes([0] + SYSTEM[1:])) == 0  # another first block: the chain differs


def test_prefix_routing_sends_a_prompt_to_the_engine_that_holds_its_prefix():
    holder, other = engine("holder", SYSTEM), engine("other")
    route = Router("prefix").choose([other, holder], SYSTEM + [7, 8, 9])
    assert (route.engine.name, route.reason, route.num_matched_blocks) == ("holder", "prefix", 4)


def test_prefix_routing_leaves_the_holder_when_its_queue_is_well_above_the_mean():
    router = Router("prefix")
    assert (
        router.choose([engine("holder", SYSTEM, queue=2), engine("other", queue=0)], SYSTEM + [1]).engine.name
        == "holder"
    )
    route = router.choose([engine("holder", SYSTEM, queue=8), engine("other", queue=0)], SYSTEM + [1])
    assert (route.engine.name, route.reason) == ("other", "load")


def test_without_a_prefix_anywhere_the_shortest_queue_wins_and_equal_ones_take_turns():
    router = Router("prefix")
    assert router.choose([engine("busy", queue=3), engine("idle", queue=1)], [1, 2, 3]).engine.name == "idle"
    names = [router.choose([engine("a"), engine("b")], [1, 2, 3]).engine.name for _ in range(4)]
    assert sorted(names) == ["a", "a", "b", "b"]


@pytest.mark.parametrize("mode", ["prefix", "load", "round_robin"])
def test_a_draining_engine_takes_nothing(mode):
    draining = engine("draining", SYSTEM)
    draining.draining = True
    router = Router(mode)
    assert {router.choose([draining, engine("open", queue=5)], SYSTEM).engine.name for _ in range(4)} == {"open"}
    assert router.choose([draining], SYSTEM) is None


def test_load_routing_ignores_prefixes_and_round_robin_ignores_load():
    holder, idle = engine("holder", SYSTEM, queue=2), engine("idle", queue=0)
    assert Router("load").choose([holder, idle], SYSTEM + [1]).engine.name == "idle"
    router = Router("round_robin")
    assert [router.choose([holder, idle], SYSTEM).engine.name for _ in range(4)] == ["holder", "idle"] * 2


def test_a_new_prefix_sent_twice_at_once_goes_to_one_engine():
    """The second prompt is routed before the first one's blocks are reported: the blocks the router sent to
    an engine count as held there until their request ends."""
    router, engines = Router("prefix"), [engine("a"), engine("b")]
    first = router.choose(engines, SYSTEM + [1, 2])
    assert first.new_block_hashes == hashes(SYSTEM)  # its full blocks (the last token is always computed)
    first.engine.routed(first.new_block_hashes)
    first.engine.num_open_here = 1
    second = router.choose(engines, SYSTEM + [3, 4])
    assert (second.engine, second.reason, second.num_matched_blocks) == (first.engine, "prefix", 4)
    first.engine.ended(first.new_block_hashes)
    first.engine.num_open_here = 0
    assert first.engine.num_matched_blocks(hashes(SYSTEM)) == 0  # only the engine's reports say so from now on


def test_only_blocks_no_engine_holds_count_as_routed():
    """A prompt sent away from the holder of its prefix (a long queue there) does not make a second holder
    before that engine reports it."""
    holder, other = engine("holder", SYSTEM, queue=8), engine("other")
    route = Router("prefix").choose([holder, other], SYSTEM + [1, 2, 3, 4, 5])
    assert route.engine is other and route.new_block_hashes == hashes(SYSTEM + [1, 2, 3, 4])[4:]


def test_routed_blocks_are_counted_per_open_request():
    view = engine("a")
    view.routed(hashes(SYSTEM))
    view.routed(hashes(SYSTEM))
    view.ended(hashes(SYSTEM))
    assert view.num_matched_blocks(hashes(SYSTEM)) == 4  # the other request is still open
    view.ended(hashes(SYSTEM))
    assert view.routed_hashes == {}


def test_a_new_prefix_goes_to_the_engine_whose_prefix_cache_holds_least():
    """Equal queues: the emptier cache evicts least, so the engines' caches split the prefixes evenly."""
    fuller, emptier = engine("fuller", list(range(200, 232))), engine("emptier", list(range(300, 308)))
    assert {Router("prefix").choose([fuller, emptier], SYSTEM).engine.name for _ in range(4)} == {"emptier"}
