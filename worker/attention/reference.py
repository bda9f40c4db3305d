"""Paged attention in plain Paddle: the reference the custom kernels are tested against, and the fallback for heads
they cannot take (in float32: layers/precision.py).

Each request's queries are cut into segments of at most `query_tile` tokens; a decode is a
segment of one. Segments of the same length are attended together: their keys and values are
gathered from the cache through the request's block table, and a causal mask by absolute
position hides what a query may not see (and the padding), and for a layer with a sliding window
the keys before it (one mask per window the model's layers have). Segments are batched so that one
batch's score tensor stays under `max_score_elements`, which bounds memory for long prefills.

Paddle's CPU kernels are slow on strided views and on broadcasts over middle axes, so masks are
built at full score shape once per step, and decodes avoid transposes altogether.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle
import paddle.nn.functional as F

from worker.attention.backend import LayerAttention
from worker.inputs.step_inputs import StepInputs
from worker.layers.rotary import RotaryEmbedding, Rotation
from worker.layers.row_gather import take_rows
from worker.models.config import ModelConfig

QUERY_TILE = 256
MAX_SCORE_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class SegmentBatch:
    """Segments attended together: `query_len` queries each, keys from `num_blocks` blocks."""

    query_rows: paddle.Tensor  # [segments * query_len] flat token index of each query (padding repeats one)
    block_ids: paddle.Tensor  # [segments * num_blocks]
    masks: dict[int | None, paddle.Tensor]  # per sliding window (None: none): 0 or -inf per (segment, head, query,
    # key), in the score layout of the attend method
    num_segments: int
    query_len: int
    num_blocks: int
    spread_rows: paddle.Tensor | None = None  # decodes: block-diagonal query rows (see _attend_decodes)
    own_rows: paddle.Tensor | None = None  # decodes: each head's own kv head in the spread output


@dataclass(frozen=True)
class PagedAttentionMetadata:
    slot_mapping: paddle.Tensor  # [tokens]
    batches: list[SegmentBatch]
    output_rows: paddle.Tensor | None  # [tokens] row of each token in the batches' joint output; None = in order


def _cut_segments(query_start: np.ndarray, requests: np.ndarray, tile: int):
    """(request of each segment, [segments, tile] flat query rows, which rows are padding).

    Padding rows repeat the segment's first query, so every row has a key to attend to.
    """
    tiles_per_request = -(-(query_start[requests + 1] - query_start[requests]) // tile)
    segment_request = np.repeat(requests, tiles_per_request)
    first_tile = np.repeat(np.cumsum(tiles_per_request) - tiles_per_request, tiles_per_request)
    start = query_start[segment_request] + (np.arange(len(segment_request)) - first_tile) * tile
    end = np.minimum(start + tile, query_start[segment_request + 1])
    query_rows = start[:, None] + np.arange(tile)[None, :]
    padded = query_rows >= end[:, None]
    return segment_request, np.where(padded, start[:, None], query_rows), padded


class PagedAttentionBackend:
    """write_kv stores a step's keys and values; attend reads each token's context through the block table."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        query_tile: int = QUERY_TILE,
        max_score_elements: int = MAX_SCORE_ELEMENTS,
        sliding_windows: tuple[int, ...] = (),
    ):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads  # head h reads kv head h // group
        self.head_dim = head_dim
        self.block_size = block_size
        self.query_tile = query_tile
        self.max_score_elements = max_score_elements
        self.scale = head_dim**-0.5
        self.windows = (None, *sorted(set(sliding_windows)))  # the masks each step builds

    def prepare(self, inputs: StepInputs) -> PagedAttentionMetadata:
        """Segment the step's queries and build the gather indices and masks, once for all layers."""
        query_lens = np.diff(inputs.query_start)
        decodes, prefills = np.flatnonzero(query_lens == 1), np.flatnonzero(query_lens > 1)
        batches, rows = [], []
        if len(decodes):
            self._add_batches(inputs, decodes, 1, batches, rows)
        if len(prefills):
            tile = int(min(self.query_tile, query_lens[prefills].max()))
            self._add_batches(inputs, prefills, tile, batches, rows)
        joint_rows = np.concatenate(rows)
        valid = joint_rows >= 0
        output_rows = np.empty(len(inputs.positions), dtype=np.int64)
        output_rows[joint_rows[valid]] = np.flatnonzero(valid)
        in_order = len(output_rows) == len(joint_rows) and (output_rows == np.arange(len(output_rows))).all()
        return PagedAttentionMetadata(
            slot_mapping=paddle.to_tensor(inputs.slot_mapping),
            batches=batches,
            output_rows=None if in_order else paddle.to_tensor(output_rows),
        )

    def _add_batches(self, inputs: StepInputs, requests: np.ndarray, tile: int, batches: list, rows: list) -> None:
        """Cut `requests` into segments of `tile` queries; append their batches and output rows."""
        segment_request, query_rows, padded = _cut_segments(inputs.query_start, requests, tile)
        query_positions = inputs.positions[query_rows]
        num_blocks = -(-int(query_positions.max() + 1) // self.block_size)
        key_positions = np.arange(num_blocks * self.block_size)
        block_ids = inputs.block_table[segment_request, :num_blocks]
        per_batch = max(1, self.max_score_elements // (self.num_heads * tile * len(key_positions)))
        for first in range(0, len(segment_request), per_batch):
            part = slice(first, first + per_batch)
            num_segments = len(query_rows[part])
            offsets = query_positions[part, :, None] - key_positions[None, None, :]  # query's position - key's
            masks = {window: self._window_mask(offsets, window) for window in self.windows}
            batches.append(
                SegmentBatch(
                    query_rows=paddle.to_tensor(query_rows[part].reshape(-1)),
                    block_ids=paddle.to_tensor(block_ids[part].reshape(-1)),
                    masks=masks,
                    num_segments=num_segments,
                    query_len=tile,
                    num_blocks=num_blocks,
                    **(self._decode_rows(num_segments) if tile == 1 else {}),
                )
            )
            rows.append(np.where(padded[part], -1, query_rows[part]).reshape(-1))

    def _decode_rows(self, segments: int) -> dict[str, paddle.Tensor]:
        """Rows for _attend_decodes: each (segment, head) query goes to its own kv head's slot of a
        group of kv_heads rows (the other slots read an appended zero row), and comes back from there."""
        heads = np.arange(segments * self.num_heads)
        own_slot = heads * self.num_kv_heads + (heads % self.num_heads) // self.group
        spread = np.full(len(heads) * self.num_kv_heads, len(heads))
        spread[own_slot] = heads
        return {"spread_rows": paddle.to_tensor(spread), "own_rows": paddle.to_tensor(own_slot)}

    def _window_mask(self, offsets: np.ndarray, window: int | None) -> paddle.Tensor:
        """The mask of keys at `offsets` positions before their query: causal, and within `window` of it."""
        visible = (offsets >= 0) if window is None else (offsets >= 0) & (offsets < window)
        return paddle.to_tensor(self._full_mask(np.where(visible, np.float32(0.0), np.float32(-np.inf))))

    def _full_mask(self, mask: np.ndarray) -> np.ndarray:
        """[segments, query_len, context] repeated over heads: [segments, heads, context] for decodes,
        [segments, kv_heads, group, query_len, context] for longer segments."""
        segments, query_len, context = mask.shape
        if query_len == 1:
            return np.ascontiguousarray(np.broadcast_to(mask, (segments, self.num_heads, context)))
        shape = (segments, self.num_kv_heads, self.group, query_len, context)
        return np.ascontiguousarray(np.broadcast_to(mask[:, None, None], shape))

    def write_kv(self, key_cache, value_cache, key, value, metadata: PagedAttentionMetadata) -> None:
        """Store key/value [tokens, kv_heads, dim] at the step's slots."""
        slots_shape = [-1, self.num_kv_heads, self.head_dim]
        paddle.scatter_(key_cache.reshape(slots_shape), metadata.slot_mapping, key, overwrite=True)
        paddle.scatter_(value_cache.reshape(slots_shape), metadata.slot_mapping, value, overwrite=True)

    def attend(
        self, query, key_cache, value_cache, metadata: PagedAttentionMetadata, layer: LayerAttention | None = None
    ) -> paddle.Tensor:
        """Attention output [tokens, heads * dim] for query [tokens, heads, dim]; `layer`: its window, scale and
        soft-cap (its rotary is the caller's)."""
        window = None if layer is None else layer.sliding_window
        scale = self.scale if layer is None or layer.scale is None else layer.scale
        softcap = None if layer is None else layer.softcap
        outputs = [
            (self._attend_decodes if batch.query_len == 1 else self._attend_segments)(
                query, key_cache, value_cache, batch, batch.masks[window], scale, softcap
            )
            for batch in metadata.batches
        ]
        output = outputs[0] if len(outputs) == 1 else paddle.concat(outputs)
        return output if metadata.output_rows is None else take_rows(output, metadata.output_rows)

    def _attend_decodes(self, query, key_cache, value_cache, batch: SegmentBatch, mask, scale, softcap):
        """One query per segment, keys and values used as gathered: [segments, context, kv_heads * dim].

        Each head's query is spread block-diagonally to [kv_heads * dim] (zeros outside its own kv
        head), which spends kv_heads times the small score flops to avoid two large transposes.
        """
        segments, dim, context = batch.num_segments, self.head_dim, batch.num_blocks * self.block_size
        heads = segments * self.num_heads
        q = take_rows(query, batch.query_rows).reshape([heads, dim]) * scale
        q = take_rows(paddle.concat([q, paddle.zeros([1, dim], q.dtype)]), batch.spread_rows)
        q = q.reshape([segments, self.num_heads, self.num_kv_heads * dim])
        k, v = (
            take_rows(cache, batch.block_ids).reshape([segments, context, self.num_kv_heads * dim])
            for cache in (key_cache, value_cache)
        )
        probs = F.softmax(_capped(paddle.matmul(q, k, transpose_y=True), softcap) + mask, axis=-1)
        out = paddle.matmul(probs, v).reshape([heads * self.num_kv_heads, dim])
        return take_rows(out, batch.own_rows).reshape([segments, self.num_heads * dim])

    def _attend_segments(self, query, key_cache, value_cache, batch: SegmentBatch, mask, scale, softcap):
        """Segments of several queries, per kv head: keys and values as [segments, kv_heads, context, dim]."""
        segments, query_len, kv_heads, dim = batch.num_segments, batch.query_len, self.num_kv_heads, self.head_dim
        context = batch.num_blocks * self.block_size
        q = take_rows(query, batch.query_rows).reshape([segments, query_len, kv_heads, self.group, dim])
        q = q.transpose([0, 2, 3, 1, 4]).reshape([segments, kv_heads, self.group * query_len, dim]) * scale
        k, v = (
            take_rows(cache, batch.block_ids).reshape([segments, context, kv_heads, dim]).transpose([0, 2, 1, 3])
            for cache in (key_cache, value_cache)
        )
        scores = _capped(paddle.matmul(q, k, transpose_y=True), softcap)
        scores = scores.reshape([segments, kv_heads, self.group, query_len, context])
        probs = F.softmax(scores + mask, axis=-1).reshape([segments, kv_heads, self.group * query_len, context])
        out = paddle.matmul(probs, v).reshape([segments, kv_heads, self.group, query_len, dim])
        return out.transpose([0, 3, 1, 2, 4]).reshape([segments * query_len, self.num_heads * dim])


def _capped(scores: paddle.Tensor, softcap: float | None) -> paddle.Tensor:
    return scores if softcap is None else paddle.tanh(scores / softcap) * softcap


@dataclass(frozen=True)
class RotaryPagedMetadata:
    paged: PagedAttentionMetadata
    positions: paddle.Tensor
    rotations: dict[int, tuple[Rotation, Rotation]]  # (query's, key's) per rotary table, by id: made once a step


class RotaryPagedAttention:
    """The model's attention on the pure-Paddle path: attend_qkv rotates, writes the cache and attends."""

    def __init__(self, backend: PagedAttentionBackend, rotary: RotaryEmbedding):
        self.backend = backend
        self.rotary = rotary

    def prepare(self, inputs: StepInputs) -> RotaryPagedMetadata:
        return RotaryPagedMetadata(self.backend.prepare(inputs), paddle.to_tensor(inputs.positions), {})

    def _rotations(self, rotary: RotaryEmbedding, metadata: RotaryPagedMetadata) -> tuple[Rotation, Rotation]:
        if id(rotary) not in metadata.rotations:
            metadata.rotations[id(rotary)] = (
                rotary.rotation(metadata.positions, self.backend.num_heads),
                rotary.rotation(metadata.positions, self.backend.num_kv_heads),
            )
        return metadata.rotations[id(rotary)]

    def attend_qkv(
        self, qkv, key_cache, value_cache, metadata: RotaryPagedMetadata, layer: LayerAttention | None = None
    ) -> paddle.Tensor:
        """Attention output [tokens, heads * dim] of the fused q|k|v projection [tokens, (heads + 2 kv_heads) * dim]."""
        backend, dim = self.backend, self.backend.head_dim
        query, key, value = paddle.split(
            qkv, [backend.num_heads * dim, backend.num_kv_heads * dim, backend.num_kv_heads * dim], axis=-1
        )
        query_rotation, key_rotation = self._rotations(self.rotary if layer is None else layer.rotary, metadata)
        query = query_rotation.apply(query.reshape([-1, backend.num_heads, dim]))
        key = key_rotation.apply(key.reshape([-1, backend.num_kv_heads, dim]))
        value = value.reshape([-1, backend.num_kv_heads, dim])
        backend.write_kv(key_cache, value_cache, key, value, metadata.paged)
        return backend.attend(query, key_cache, value_cache, metadata.paged, layer)


def paddle_paged_attention(config: ModelConfig, block_size: int, rotary: RotaryEmbedding) -> RotaryPagedAttention:
    """The pure-Paddle attention for the model's heads (and the windows of its layers)."""
    windows = tuple(w for w in config.sliding_windows if w is not None)
    backend = PagedAttentionBackend(
        config.num_heads, config.num_kv_heads, config.head_dim, block_size, sliding_windows=windows
    )
    return RotaryPagedAttention(backend, rotary)
