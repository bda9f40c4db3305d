"""Grammar masks on a step's logits: the tokens a grammar forbids at -inf before the draw.

A mask is llguidance's packed bitmask: per row ceil(vocab / 32) int32 words, bit j of word w allowing token
32 w + j. Only the constrained rows carry one. It is applied after penalties and logit_bias (a -inf stays -inf
under both, so nothing brings a forbidden token back) and before temperature, min_p, top_k and top_p.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle


@dataclass(frozen=True)
class TokenMask:
    """`bitmask[i]` (int32 words) allows the tokens of row `rows[i]` of the step's sampling rows."""

    rows: np.ndarray  # int64 [constrained rows], increasing
    bitmask: np.ndarray  # int32 [constrained rows, words]


def allowed_tokens(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool [rows, vocab_size]: the bits of a packed bitmask (bit j of word w is token 32 w + j)."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab_size].astype(bool)


def mask_rows(logits: paddle.Tensor, mask: TokenMask) -> paddle.Tensor:
    """Logits [rows, vocab] with each masked row's forbidden tokens at -inf, in Paddle ops: the reference of the
    custom CPU op bs_mask_rows, and the path of the other kernels. The bits travel packed (a row of an unmasked
    request all ones), 32 tokens to an int32 word: on a GPU they unpack there (`unpacked_bits`), on a CPU in NumPy
    (Paddle's CPU shifts took 10 ms for 16 rows of SmolLM2's 49152 logits, NumPy's unpack 1.4 ms)."""
    num_rows, vocab_size = logits.shape
    words = np.full((num_rows, mask.bitmask.shape[1]), -1, dtype=np.int32)
    words[mask.rows] = mask.bitmask
    if logits.place.is_cpu_place():
        allowed = paddle.to_tensor(allowed_tokens(words, vocab_size))
    else:
        allowed = unpacked_bits(paddle.to_tensor(words, place=logits.place), vocab_size)
    return paddle.where(allowed, logits, paddle.full_like(logits, -np.inf))


def unpacked_bits(words: paddle.Tensor, width: int) -> paddle.Tensor:
    """bool [rows, width] from int32 words [rows, words] (bit j of word w is column 32 w + j), in Paddle ops."""
    shifts = paddle.arange(32, dtype="int32").to(words.place)
    bits = paddle.bitwise_and(paddle.bitwise_right_shift(words.unsqueeze(-1), shifts), paddle.ones([1], dtype="int32"))
    return bits.reshape([words.shape[0], -1])[:, :width].astype("bool")


def masked_argmax(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """int64 [rows]: each row's allowed token (under its packed mask) of the largest logit, the first of equals.
    A host path, for the few rows the worker draws again (model_runner.py's greedy rows checked after); it reads
    only the allowed logits, mostly a few of a grammar's row."""
    tokens = np.empty(len(logits), dtype=np.int64)
    for row, allowed in enumerate(allowed_tokens(bitmask, logits.shape[1])):
        allowed_ids = np.flatnonzero(allowed)
        tokens[row] = allowed_ids[np.argmax(logits[row, allowed_ids])] if len(allowed_ids) else -1
    return tokens
