"""A Prometheus histogram that takes a whole step's observations at once.

Inter-token latencies arrive one per running request per step: observing them one by one costs
about a microsecond each, as much as the scheduling itself. Here a step's values are bucketed in
one numpy call; scrapes read the counts under a lock (they run on the metrics server's thread).
"""

from __future__ import annotations

import math
import threading
from typing import Callable

import numpy as np
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class BatchHistogram(Collector):
    """A histogram with one `model_name` label; the current model's series exists from the start."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], get_model_name: Callable[[], str]):
        self.name = name
        self.documentation = documentation
        self.upper_bounds = np.array([*buckets, math.inf])
        self.get_model_name = get_model_name
        self._lock = threading.Lock()
        self._counts: dict[str, np.ndarray] = {}  # model -> observations per bucket (not cumulative)
        self._sums: dict[str, float] = {}

    def observe_many(self, model: str, values: list[float]) -> None:
        counts = np.bincount(np.searchsorted(self.upper_bounds, values), minlength=len(self.upper_bounds))
        total = math.fsum(values)
        with self._lock:
            if model in self._counts:
                self._counts[model] += counts
                self._sums[model] += total
            else:
                self._counts[model], self._sums[model] = counts, total

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])
        with self._lock:
            series = {model: (np.cumsum(counts), self._sums[model]) for model, counts in self._counts.items()}
        model = self.get_model_name()
        if model and model not in series:
            series[model] = (np.zeros(len(self.upper_bounds), dtype=np.int64), 0.0)
        for name, (cumulative, total) in series.items():
            buckets = [(floatToGoString(bound), int(count)) for bound, count in zip(self.upper_bounds, cumulative)]
            family.add_metric([name], buckets, sum_value=total)
        yield family
