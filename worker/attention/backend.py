"""What the model asks of a paged attention backend, whichever serves it: the pure-Paddle reference
(attention/reference.py) or the custom C++ and CUDA ops (attention/custom_kernels.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import paddle

from worker.inputs.step_inputs import StepInputs
from worker.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class LayerAttention:
    """How one layer's attention differs from the model-wide default (a family's variations: models/config.py)."""

    rotary: RotaryEmbedding  # its cos/sin tables (no rotation: cos 1, sin 0)
    sliding_window: int | None = None  # keys within this many positions of the query, itself included
    scale: float | None = None  # on q.k; None: head_dim ** -0.5
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap)


class AttentionBackend(Protocol):
    """`prepare` once per step, `attend_qkv` per layer: the rotary embedding, the KV-cache write and the attention."""

    def prepare(self, inputs: StepInputs) -> object:
        """The step's metadata, shared by every layer."""
        ...

    def attend_qkv(
        self,
        qkv: paddle.Tensor,
        key_cache: paddle.Tensor,
        value_cache: paddle.Tensor,
        metadata: object,
        layer: LayerAttention | None = None,
    ) -> paddle.Tensor:
        """Attention output [tokens, heads * dim] of the fused q|k|v projection [tokens, (heads + 2 kv_heads) * dim],
        for a layer whose attention differs as `layer` says (None: the backend's own rotary, nothing else)."""
        ...
