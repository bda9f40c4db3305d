"""Pick the next token of every request that finished its scheduled tokens, vectorised over the batch.

Order, as in vLLM: penalties and logit_bias, the grammar mask of constrained rows (sample/token_mask.py), then greedy (temperature 0) or temperature, min_p, top_k, top_p and
an inverse-CDF draw. The draw of a seeded request is a uniform from a generator seeded with
(seed, sequence length), so it does not depend on its batch mates or on a preemption. Its tokens repeat
exactly as far as the logits do (a grammar mask changes which tokens the uniform can land on, not the uniform): in float32 a recompute's logits are the decode's to ~1e-4, but in
bfloat16 the activations are rounded after sums whose order depends on how a step batches the tokens
(SmolLM2 on a 200-token text, 8 tokens per step against 1: logits apart by 0.05 on average, 0.4 at
most), so a draw that falls near a boundary between two tokens may differ. Logprobs come from the raw
model logits: before penalties, logit_bias and the grammar mask (a top logprob may name a token the grammar
forbade), as vLLM's default.

The draw is the kernels' sample_rows (sample/paddle_draw.py in Paddle ops; on a CPU the custom op
bs_sample_rows): rows without top_k/top_p draw over the vocabulary in id order (no sort); rows that
truncate walk their top tokens from the largest down.

Everything stays on the logits' device until `Draw.fetch()`, which copies the tokens and the asked
logprobs to the host in one transfer; on a GPU the worker keeps `Draw.tokens` there for the next
step's inputs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import paddle

from service.contract import wire
from worker.layers.row_gather import take_rows
from worker.sample import paddle_draw, token_mask
from worker.sample.penalties import SamplingRequest, apply_logit_bias, apply_penalties
from worker.sample.token_mask import TokenMask

GREEDY_TEMPERATURE = 1e-5  # below this, temperature sampling is argmax


def _rows(tensor: paddle.Tensor, selected: np.ndarray) -> paddle.Tensor:
    if selected.all():  # one kind of request in the batch (the usual case): no copy of the logits
        return tensor
    return take_rows(tensor, paddle.to_tensor(np.flatnonzero(selected)))


@dataclass(frozen=True)
class Draw:
    """One step's sampling, queued on the device: `tokens` [rows] int64 there, `fetch()` for the host."""

    requests: Sequence[SamplingRequest]
    tokens: paddle.Tensor
    # The tokens alone (int64) where no row asked for logprobs; else float64: the tokens, then per logprobs row
    # its logprob and top-k values and ids.
    packed: paddle.Tensor
    logprob_rows: np.ndarray  # rows that asked for logprobs
    max_k: int
    mask_s: float = 0.0  # applying the grammar mask (host time: on a GPU, queuing it)

    def fetch(self) -> list[wire.SampledToken]:
        """The sampled tokens with their logprobs (one device-to-host copy)."""
        host = self.packed.numpy()
        rows = len(self.requests)
        tokens = host[:rows].astype(np.int64)
        sampled = [wire.SampledToken(r.request_id, int(t)) for r, t in zip(self.requests, tokens)]
        logprobs = host[rows:].reshape(len(self.logprob_rows), 1 + 2 * self.max_k)
        for values, row in zip(logprobs, self.logprob_rows):
            k = self.requests[row].sampling.logprobs
            top_values, top_ids = values[1 : 1 + self.max_k], values[1 + self.max_k :]
            top = [wire.TokenLogprob(int(top_ids[j]), float(top_values[j])) for j in range(k)]
            sampled[row] = wire.SampledToken(self.requests[row].request_id, int(tokens[row]), float(values[0]), top)
        return sampled


class Sampler:
    """`sample(logits, requests)` -> one SampledToken per row; `draw` leaves the result on the device."""

    def __init__(
        self,
        seed: int | None = None,
        argmax: Callable[[paddle.Tensor], paddle.Tensor] | None = None,
        sample_rows: Callable[[paddle.Tensor, np.ndarray], paddle.Tensor] | None = None,
        mask_rows: Callable[[paddle.Tensor, TokenMask], paddle.Tensor] | None = None,
    ):
        self._rng = np.random.default_rng(seed)
        # The worker passes its kernels' argmax_rows, sample_rows and mask_rows; by default they are Paddle's.
        self._argmax = argmax or paddle_draw.argmax_rows
        self._sample_rows = sample_rows or paddle_draw.sample_rows
        self._mask_rows = mask_rows or token_mask.mask_rows

    def sample(
        self, logits: paddle.Tensor, requests: Sequence[SamplingRequest], mask: TokenMask | None = None
    ) -> list[wire.SampledToken]:
        return self.draw(logits, requests, mask).fetch()

    def draw(self, logits: paddle.Tensor, requests: Sequence[SamplingRequest], mask: TokenMask | None = None) -> Draw:
        """The draw of every row; `mask` forbids tokens to the rows it names (a grammar's)."""
        logits = logits if logits.dtype == paddle.float32 else logits.astype("float32")
        params = [r.sampling for r in requests]
        if mask is None and all(plain_greedy(p) for p in params):  # what the path below draws, without its arrays
            tokens = self._argmax(logits)
            return Draw(requests, tokens, tokens, _NO_ROWS, 0)
        greedy = np.array([p.temperature < GREEDY_TEMPERATURE for p in params])
        penalised = apply_logit_bias(apply_penalties(logits, requests), requests)
        mask_s = 0.0
        if mask is not None:
            started = time.perf_counter()
            penalised = self._mask_rows(penalised, mask)
            mask_s = time.perf_counter() - started
        uniforms = self._uniforms(requests, ~greedy)
        groups, group_tokens = [], []
        if greedy.any():
            groups.append(np.flatnonzero(greedy))
            group_tokens.append(self._argmax(_rows(penalised, greedy)))
        if not greedy.all():
            drawn = np.flatnonzero(~greedy)
            table = [
                [p.temperature, min(p.min_p, 1.0), uniform, max(p.top_k, 0), p.top_p]
                for p, uniform in zip(_select(params, ~greedy), uniforms[drawn])
            ]
            groups.append(drawn)
            group_tokens.append(self._sample_rows(_rows(penalised, ~greedy), np.array(table, dtype=np.float64)))
        draw = _with_logprobs(logits, requests, paddle_draw.in_row_order(groups, group_tokens))
        return dataclasses.replace(draw, mask_s=mask_s) if mask is not None else draw

    def _uniforms(self, requests: Sequence[SamplingRequest], needed: np.ndarray) -> np.ndarray:
        """One uniform in [0, 1) per request: seeded from (seed, length) or from the worker's generator."""
        uniforms = self._rng.random(len(requests))
        for row in np.flatnonzero(needed):
            seed = requests[row].sampling.seed
            if seed is not None:
                uniforms[row] = np.random.default_rng([seed % 2**64, len(requests[row].token_ids)]).random()
        return uniforms


_NO_ROWS = np.zeros(0, dtype=np.int64)


def plain_greedy(params: wire.SamplingParams) -> bool:
    """Greedy, and nothing changes the raw logits' argmax or asks for more: no penalty, logit_bias or logprobs.
    A batch of only these (a benchmark's, a greedy client's) takes the argmax alone: at one sequence the general
    path's small arrays and ops cost ~0.1-0.2 ms of a few-millisecond step."""
    return (
        params.temperature < GREEDY_TEMPERATURE
        and params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and not params.logit_bias
        and params.logprobs is None
    )


def _select(params: list[wire.SamplingParams], selected: np.ndarray) -> list[wire.SamplingParams]:
    return [params[i] for i in np.flatnonzero(selected)]


def log_softmax(logits: paddle.Tensor) -> paddle.Tensor:
    """log_softmax over the last axis (Paddle's own CPU kernel takes seconds on a [64, 49152] batch)."""
    shifted = logits - logits.max(axis=-1, keepdim=True)
    return shifted - paddle.log(paddle.exp(shifted).sum(axis=-1, keepdim=True))


def _with_logprobs(logits: paddle.Tensor, requests: Sequence[SamplingRequest], tokens: paddle.Tensor) -> Draw:
    """The draw, with the chosen token's logprob and the top-k packed for the rows that asked."""
    wanted = np.array([r.sampling.logprobs is not None for r in requests])
    rows = np.flatnonzero(wanted)
    max_k = max((requests[row].sampling.logprobs for row in rows), default=0)
    if not len(rows):
        return Draw(requests, tokens, tokens, rows, max_k)  # the tokens alone: nothing to pack with them
    logprobs = log_softmax(_rows(logits, wanted))
    chosen_ids = paddle.gather(tokens, paddle.to_tensor(rows)).unsqueeze(-1)
    parts = [paddle.take_along_axis(logprobs, chosen_ids, axis=-1)]
    if max_k:
        top_values, top_ids = paddle.topk(logprobs, max_k, axis=-1)
        parts += [top_values, top_ids.astype(logprobs.dtype)]
    packed = [tokens.astype("float64"), paddle.concat(parts, axis=-1).astype("float64").reshape([-1])]
    return Draw(requests, tokens, paddle.concat(packed), rows, max_k)
