"""What a step costs on this device, learned from the compute times the worker reports.

A step's time is modelled as `fixed + per_request × requests + per_token × tokens + per_context
× attended`, where `attended` counts, in thousands, the cached tokens each computed token reads
(attention grows with context). The coefficients are fitted by exponentially weighted,
non-negative least squares (every subset of the terms is tried: there are four), so the model
follows the device and the load. The scheduler sizes prefill chunks with it so that running
streams keep their inter-token latency target.

Until it has seen `MIN_OBSERVATIONS` steps the model is not trusted with four terms: it prices
every token at the seconds per token of the steps it has seen (a fit through the origin, which
counts the fixed costs too, so it never underprices a chunk the size of those it has timed).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

TERMS = ("fixed", "per_request", "per_token", "per_context_kilotoken")
PER_TOKEN = TERMS.index("per_token")
MIN_OBSERVATIONS = 8  # before this many steps, only the seconds per token are trusted
DECAY = 0.98  # weight of the past per observed step (about the last 50 steps count)
RIDGE = 1e-9  # relative to each term's own scale: keeps a fit defined when two terms moved together
REFIT_EVERY = 8  # observations between two fits (a fit solves 15 small systems)
UNLIMITED_TOKENS = 1 << 30  # what fits when tokens cost nothing
SUBSETS = [
    list(terms) for size in range(1, len(TERMS) + 1) for terms in itertools.combinations(range(len(TERMS)), size)
]


class StepCostModel:
    def __init__(self) -> None:
        self._xtx = np.zeros((len(TERMS), len(TERMS)))
        self._xty = np.zeros(len(TERMS))
        self._coefficients = np.zeros(len(TERMS))
        self._fitted_at = 0  # observations at the latest fit
        self.num_observations = 0

    @property
    def ready(self) -> bool:
        return self.num_observations >= MIN_OBSERVATIONS

    def observe(self, num_requests: int, num_tokens: int, attended_tokens: int, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"a step cannot take {seconds} s")
        x = np.array((1.0, num_requests, num_tokens, attended_tokens / 1000))
        self._xtx = DECAY * self._xtx + np.outer(x, x)
        self._xty = DECAY * self._xty + x * seconds
        self.num_observations += 1

    def coefficients(self) -> dict[str, float]:
        """Seconds per unit of each term (all zero before the first observation), refitted when due."""
        if not self.ready:
            self._coefficients = self._seconds_per_token()
        elif self.num_observations - self._fitted_at >= REFIT_EVERY or not self._fitted_at:
            self._coefficients = self._fit()
            self._fitted_at = self.num_observations
        return self.fitted()

    def fitted(self) -> dict[str, float]:
        """The coefficients as last computed (what a reader on another thread may see without fitting)."""
        return dict(zip(TERMS, self._coefficients.tolist()))

    def _seconds_per_token(self) -> np.ndarray:
        """Every second of the steps seen charged to their tokens: Σ tokens·seconds / Σ tokens²."""
        beta = np.zeros(len(TERMS))
        if self._xtx[PER_TOKEN, PER_TOKEN] > 0:
            beta[PER_TOKEN] = self._xty[PER_TOKEN] / self._xtx[PER_TOKEN, PER_TOKEN]
        return beta

    def _fit(self) -> np.ndarray:
        """The non-negative coefficients of least weighted squared error: the best of the subsets' fits
        that come out non-negative (the squared error is up to a constant −2β·Xᵀy + β·XᵀXβ). Each
        subset is solved on terms scaled to unit size, by least squares, so that neither the terms'
        units (ones next to millions of tokens²) nor two terms that always moved together (as many
        requests as tokens) make it singular; a term that never moved from zero is left out."""
        scale = np.sqrt(np.diag(self._xtx))
        best, best_error = np.zeros(len(TERMS)), 0.0
        for subset in SUBSETS:
            term_scale = scale[subset]
            if not term_scale.all():
                continue
            xtx = self._xtx[np.ix_(subset, subset)] / np.outer(term_scale, term_scale)
            xtx[np.diag_indices_from(xtx)] += RIDGE
            solved = np.linalg.lstsq(xtx, self._xty[subset] / term_scale, rcond=None)[0] / term_scale
            if (solved < 0).any() or not np.isfinite(solved).all():
                continue
            beta = np.zeros(len(TERMS))
            beta[subset] = solved
            error = beta @ self._xtx @ beta - 2 * beta @ self._xty
            if error < best_error:
                best, best_error = beta, error
        return best

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
            return UNLIMITED_TOKENS
        return int(min(max(0.0, (budget_s - base) / per_token), UNLIMITED_TOKENS))  # a tiny price: no overflow
