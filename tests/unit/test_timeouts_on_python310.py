"""`asyncio.wait_for` timeouts are caught as Python 3.10 raises them (pyproject admits 3.10).

Before 3.11, `asyncio.TimeoutError` is its own class, not the builtin `TimeoutError`; a bare
`except TimeoutError` around `wait_for` lets it through there. These tests give asyncio 3.10's
class and a `wait_for` that times out at once, and check each waiter treats it as a timeout.
"""

from __future__ import annotations

import asyncio

import pytest

from service.api.scheduler_client import SchedulerClient
from service.tools.bench import metrics_sampler
from service.tools.bench.metrics_sampler import MetricsTimeline


class Python310TimeoutError(Exception):
    """asyncio.exceptions.TimeoutError as Python 3.10 defines it: not a builtin TimeoutError."""


@pytest.fixture
def asyncio_of_python310(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """asyncio.TimeoutError is 3.10's class and every wait_for times out; returns what was awaited."""
    awaited: list[object] = []

    async def wait_for_that_times_out(awaitable: object, timeout: float | None) -> object:
        awaited.append(awaitable)
        if asyncio.iscoroutine(awaitable):
            awaitable.close()
        raise Python310TimeoutError

    assert not issubclass(Python310TimeoutError, TimeoutError)
    monkeypatch.setattr(asyncio, "TimeoutError", Python310TimeoutError)
    monkeypatch.setattr(asyncio, "wait_for", wait_for_that_times_out)
    return awaited


def test_status_that_times_out_is_none_not_an_exception(asyncio_of_python310: list[object]) -> None:
    async def ask() -> object:
        client = SchedulerClient("tcp://127.0.0.1:1", "replica-0", idle_check_s=0.1)
        client._send = lambda message: True  # the query left; no answer will come
        try:
            return await client.status(timeout_s=0.01)
        finally:
            client._context.destroy(linger=0)

    assert asyncio.run(ask()) is None
    assert len(asyncio_of_python310) == 1


def test_metrics_sampler_waits_out_its_interval_on_python310(asyncio_of_python310: list[object]) -> None:
    stop = asyncio.Event()
    first_sample = asyncio.Event()
    timeline = MetricsTimeline()
    real_set = first_sample.set

    def set_first_and_stop() -> None:
        real_set()
        if len(asyncio_of_python310) == 1:
            stop.set()  # one interval timed out: the next pass samples once more and returns

    first_sample.set = set_first_and_stop  # type: ignore[method-assign]

    async def sample() -> None:
        await metrics_sampler.sample_until("http://127.0.0.1:1/metrics", stop, first_sample, timeline, 0.01, 0.0)

    asyncio.run(sample())
    assert first_sample.is_set()
    assert len(asyncio_of_python310) == 1
