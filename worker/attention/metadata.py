"""A step's attention metadata as the custom ops take it: five tensors (built on the device from a step delta,
or from the host's arrays as the ops ask for them), or one int64 layout with the step's ids (the fused decoder
stack's)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import paddle

from worker.inputs.step_inputs import StepInputs


@dataclass(frozen=True)
class CustomAttentionMetadata:
    positions: paddle.Tensor  # [tokens]
    slot_mapping: paddle.Tensor  # [tokens]
    query_start: paddle.Tensor  # [requests + 1]
    context_lens: paddle.Tensor  # [requests]
    block_table: paddle.Tensor  # [requests, max blocks]


class HostAttentionMetadata:
    """A step's attention inputs on the host, made into tensors as the ops ask: bs_decoder_stack takes them and the
    step's token ids in one int64 tensor (`layout`), the single ops each its own (`split`). A tensor from numpy is
    a ~15 us Paddle call, and ~60-90 us right after a step of one sequence, whose weights stream through every
    cache: five of them spent 130-220 us of a 4-5 ms gguf step (AMD EPYC Zen 4, 2 threads)."""

    def __init__(self, inputs: StepInputs):
        self.inputs = inputs

    @functools.cached_property
    def layout(self) -> paddle.Tensor:
        """int64 [3 + 3 tokens + 2 requests + 1 + requests * table width]: the numbers of tokens and requests and
        the block table's width, then input_ids, positions, slot_mapping, query_start, context_lens and the block
        table's rows (what StepLayout in custom_ops/cpu/paged_attention.h reads). Made when the forward first asks
        for it, once the step's ids are all known (model_runner.fill_pending_tokens)."""
        i = self.inputs
        counts = np.array([len(i.positions), len(i.context_lens), i.block_table.shape[1]], dtype=np.int64)
        parts = (counts, i.input_ids, i.positions, i.slot_mapping, i.query_start, i.context_lens, i.block_table.ravel())
        return paddle.to_tensor(np.concatenate(parts).astype(np.int64, copy=False))

    @functools.cached_property
    def split(self) -> CustomAttentionMetadata:
        i = self.inputs
        arrays = (i.positions, i.slot_mapping, i.query_start, i.context_lens, i.block_table)
        return CustomAttentionMetadata(*(paddle.to_tensor(array) for array in arrays))

    positions = property(lambda self: self.split.positions)
    slot_mapping = property(lambda self: self.split.slot_mapping)
    query_start = property(lambda self: self.split.query_start)
    context_lens = property(lambda self: self.split.context_lens)
    block_table = property(lambda self: self.split.block_table)
