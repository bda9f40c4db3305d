"""The Llama decoder stack in one C++ op per step (bs_decoder_stack, custom_ops/cpu/decoder_stack_op.cc): the
embedding lookup, every decoder layer and the final norm, with the kernels of the single ops, for every family whose
layers are Llama's (ModelConfig.is_llama_layer). It is tested against models/decoder.py's op-by-op layers, the
reference."""

from __future__ import annotations

import weakref
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import paddle

from worker.attention.custom_kernels import CustomPagedAttention
from worker.attention.metadata import HostAttentionMetadata
from worker.models.config import ModelConfig

if TYPE_CHECKING:
    from worker.inputs.model_inputs import ModelInputs

# bs_decoder_stack's stages, in the order of its StageSeconds output. In a decode step of at least as many
# sequences as threads, the attention's tiles rotate and write their own tokens: "attention" holds the rope + KV write.
STACK_STAGES = ("embedding", "norms", "qkv", "rope + KV write", "attention", "o", "gate_up", "silu", "down")


class FusedDecoderStack:
    """`(model, kv_cache, layout) -> the final norm's output [tokens, hidden]` through bs_decoder_stack: the
    embedding lookup of the ids in the step's layout, every decoder layer and the final norm, with the same kernels
    as the single ops, in one Paddle op call per step. The op holds the model's embedding, layers' norms, weights
    and caches and final norm (bs_decoder_stack_hold) under a handle, taken again when the model holds another
    of them or the cache another tensor, and let go (bs_decoder_stack_release) then, on release(), and when the
    stack is dropped."""

    def __init__(self, ops: ModuleType, attention: CustomPagedAttention, config: ModelConfig):
        self.ops = ops
        self.attention = attention
        self.config = config
        self._held_for: list = []  # the layers and caches the op holds, by identity
        self.handle: paddle.Tensor | None = None  # what the op holds them under (None: nothing yet)
        self._release: weakref.finalize | None = None
        # Off in the service. On, each call adds the wall time of each of its stages (STACK_STAGES order, summed
        # over the layers) to stage_seconds: where a benchmark's fused step goes.
        self.time_stages = False
        self._stage_seconds = np.zeros(len(STACK_STAGES))
        # The calls' clocks not yet added: read when stage_seconds is, so that a timed step does not pay for
        # reading them (right after a step, a tensor's first .numpy() takes ~0.1 ms: its memory is cold).
        self._unread_clocks: list[paddle.Tensor] = []

    def hold(self, model, kv_cache) -> paddle.Tensor:
        """The handle under which the op holds the model's embedding, layers and final norm and the cache's
        tensors (model: models/decoder.py's CausalDecoder, whose embedding is a PackedEmbedding)."""
        layers, embedding = model.layers, model.embed_tokens.weight
        key_caches, value_caches = kv_cache.key_caches, kv_cache.value_caches
        held_for = [embedding.packed, model.norm, *layers, *key_caches, *value_caches]
        if len(held_for) != len(self._held_for) or any(a is not b for a, b in zip(held_for, self._held_for)):
            self.release()
            self.handle = self.ops.bs_decoder_stack_hold(
                embedding.packed,
                model.norm,
                *layer_inputs(layers),
                key_caches,
                value_caches,
                [int(linear.format) for layer in layers for linear in layer.linears],
                self.config.num_heads,
                self.config.num_kv_heads,
                self.config.intermediate_size,
                int(embedding.format),
                embedding.out_features,
            )
            self._release = weakref.finalize(self, self.ops.bs_decoder_stack_release, self.handle)
            self._release.atexit = False  # at exit the process lets go of everything
            self._held_for = held_for
        return self.handle

    def release(self) -> None:
        """Let go of the layers and caches the op holds (the next call takes them again)."""
        if self._release is not None:
            self._release()
        self._held_for, self.handle, self._release = [], None, None

    def __call__(self, model, kv_cache, layout: paddle.Tensor) -> paddle.Tensor:
        """The final norm's output for the step in `layout` (step_layout)."""
        hidden, stage_seconds = self.ops.bs_decoder_stack(
            self.hold(model, kv_cache),
            layout,
            self.attention.rotary.cos,
            self.attention.rotary.sin,
            self.config.rms_norm_eps,
            self.attention.query_tile,
            self.attention.isa,
            self.time_stages,
        )
        if self.time_stages:
            self._unread_clocks.append(stage_seconds)
        return hidden

    @property
    def stage_seconds(self) -> np.ndarray:
        """Seconds per stage (STACK_STAGES order) of every call made with time_stages on."""
        for clock in self._unread_clocks:
            self._stage_seconds += clock.numpy()
        self._unread_clocks.clear()
        return self._stage_seconds


def layer_inputs(layers: list) -> list:
    """The norms, packed weights and biases (None: no layer has them) of `layers`, in bs_decoder_stack_hold's
    order. A GGUF file may store a projection in other formats in some layers: the op takes each one's."""
    per_kind = [[layer.input_norm for layer in layers], [layer.post_attention_norm for layer in layers]]
    per_kind += [[layer.linears[i].packed for layer in layers] for i in range(4)]
    for i in range(4):
        biases = [layer.linears[i].bias for layer in layers]
        if any(bias is None for bias in biases) and any(bias is not None for bias in biases):
            raise ValueError("a projection has a bias in some layers only")
        per_kind.append(None if biases[0] is None else biases)
    return per_kind


def step_layout(inputs: ModelInputs) -> paddle.Tensor:
    """The step's ids and attention metadata as HostAttentionMetadata.layout lays them out: that layout itself, or
    one built from the ids tensor and the five metadata tensors."""
    metadata = inputs.attention_metadata
    if isinstance(metadata, HostAttentionMetadata):
        return metadata.layout
    block_table = metadata.block_table
    counts = [metadata.positions.shape[0], metadata.context_lens.shape[0], block_table.shape[1]]
    parts = [inputs.input_ids, metadata.positions, metadata.slot_mapping, metadata.query_start, metadata.context_lens]
    return paddle.concat([paddle.to_tensor(counts, dtype="int64"), *parts, block_table.reshape([-1])])
