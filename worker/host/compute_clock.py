"""How long the device may still compute the step launched last, so the worker loop knows how long
it can wait for the scheduler's next step (and prepare it) before it must collect this one.

On a CPU the forward has finished when launch returns: 0. On a GPU launch only queues kernels: a
CUDA event recorded after them says when they are done; until then the estimate is the last step's
compute time less the time since this one was launched.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol


class DeviceEvent(Protocol):
    def record(self) -> None: ...

    def query(self) -> bool: ...


class ComputeClock:
    def __init__(self, new_event: Callable[[], DeviceEvent] | None, now: Callable[[], float] = time.perf_counter):
        self._new_event = new_event  # None on a CPU
        self._now = now
        self._event: DeviceEvent | None = None
        self._launched_at = 0.0
        self._last_compute_s = 0.0

    def launched(self) -> None:
        """The step's work is queued."""
        self._launched_at = self._now()
        if self._new_event is not None:
            self._event = self._new_event()
            self._event.record()

    def finished(self) -> None:
        """The step's results are on the host."""
        self._last_compute_s = self._now() - self._launched_at
        self._event = None

    def remaining_s(self) -> float:
        if self._event is None or self._event.query():
            return 0.0
        return max(0.0, self._last_compute_s - (self._now() - self._launched_at))


def gpu_event() -> DeviceEvent:
    import paddle

    return paddle.device.cuda.Event()
