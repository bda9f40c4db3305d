"""What the model asks of a paged attention backend, whichever serves it: the pure-Paddle reference
(attention/reference.py) or the custom C++ and CUDA ops (attention/custom_kernels.py)."""

from __future__ import annotations

from typing import Protocol

import paddle

from worker.inputs.step_inputs import StepInputs


class AttentionBackend(Protocol):
    """`prepare` once per step, `attend_qkv` per layer: the rotary embedding, the KV-cache write and the attention."""

    def prepare(self, inputs: StepInputs) -> object:
        """The step's metadata, shared by every layer."""
        ...

    def attend_qkv(
        self, qkv: paddle.Tensor, key_cache: paddle.Tensor, value_cache: paddle.Tensor, metadata: object
    ) -> paddle.Tensor:
        """Attention output [tokens, heads * dim] of the fused q|k|v projection [tokens, (heads + 2 kv_heads) * dim]."""
        ...
