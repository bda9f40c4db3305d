"""What a step costs on this device, learned from the compute times the worker reports.

A step's time is modelled as `fixed + per_request × requests + per_token × tokens + per_context
× attended`, where `attended` counts, in thousands, the cached tokens each computed token reads
(attention grows with context). The coefficients are fitted by exponentially weighted least
squares, so the model follows the device and the load; they are never negative. The scheduler
sizes prefill chunks with it so that running streams keep their inter-token latency target.
"""

from __future__ import annotations

import numpy as np

TERMS = ("fixed", "per_request", "per_token", "per_context_kilotoken")
MIN_OBSERVATIONS = 8  # before this many steps the model is not trusted: the token budget alone decides
DECAY = 0.98  # weight of the past per observed step (about the last 50 steps count)
RIDGE = 1e-9  # keeps the fit defined before every term has varied


class StepCostModel:
    def __init__(self) -> None:
        self._xtx = np.zeros((len(TERMS), len(TERMS)))
        self._xty = np.zeros(len(TERMS))
        self._coefficients: np.ndarray | None = None
        self.num_observations = 0

    @property
    def ready(self) -> bool:
        return self.num_observations >= MIN_OBSERVATIONS

    def observe(self, num_requests: int, num_tokens: int, attended_tokens: int, seconds: float) -> None:
        x = np.array((1.0, num_requests, num_tokens, attended_tokens / 1000))
        self._xtx = DECAY * self._xtx + np.outer(x, x)
        self._xty = DECAY * self._xty + x * seconds
        self._coefficients = None
        self.num_observations += 1

    def coefficients(self) -> dict[str, float]:
        """Seconds per unit of each term (all zero before the first observation)."""
        if self._coefficients is None:
            fitted = np.linalg.lstsq(self._xtx + RIDGE * np.eye(len(TERMS)), self._xty, rcond=None)[0]
            self._coefficients = np.maximum(fitted, 0.0)
        return dict(zip(TERMS, self._coefficients.tolist()))

    def prefill_tokens_within(
        self, budget_s: float, num_decodes: int, decode_attended: int, prefill_context: int
    ) -> int:
        """How many prefill tokens, each reading about `prefill_context` cached tokens, fit in `budget_s`
        beside `num_decodes` single-token requests that read `decode_attended` cached tokens in all."""
        c = self.coefficients()
        base = c["fixed"] + c["per_request"] * (num_decodes + 1) + c["per_token"] * num_decodes
        base += c["per_context_kilotoken"] * decode_attended / 1000
        per_token = c["per_token"] + c["per_context_kilotoken"] * prefill_context / 1000
        if per_token <= 0:
            return 1 << 30
        return max(0, int((budget_s - base) / per_token))
