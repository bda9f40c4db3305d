"""Llama-family decoder (Llama, SmolLM2, Qwen2) over a flat batch of tokens with a paged KV cache.

Written for Paddle's CPU kernels: every projection is its own matmul so its output is
contiguous (elementwise ops on strided slices, and broadcasting over middle axes, are many
times slower there), and residual adds are fused into the RMS norms.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle
import paddle.nn.functional as F

from gpu_worker.attention import PagedAttentionBackend
from gpu_worker.kv_cache import KVCache
from gpu_worker.model_config import ModelConfig
from gpu_worker.models.rope import RotaryEmbedding

PROJECTIONS = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


@dataclass(frozen=True)
class Linear:
    weight: paddle.Tensor  # [in, out]
    bias: paddle.Tensor | None

    def __call__(self, x: paddle.Tensor) -> paddle.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass(frozen=True)
class DecoderLayer:
    input_norm: paddle.Tensor
    post_attention_norm: paddle.Tensor
    projections: dict[str, Linear]


class LlamaForCausalLM:
    """The decoder stack; `forward` fills the KV cache and returns hidden states per token."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], max_positions: int):
        self.config = config
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, max_positions)
        self.embed_tokens = paddle.to_tensor(weights.pop("model.embed_tokens.weight"))
        self.layers = [self._layer(weights, f"model.layers.{i}.") for i in range(config.num_layers)]
        self.norm = paddle.to_tensor(weights.pop("model.norm.weight"))
        lm_head = weights.pop("lm_head.weight", None)
        # Tied models multiply by the embedding itself (transposed in the matmul), not a copy.
        self.lm_head = self.embed_tokens if lm_head is None else paddle.to_tensor(lm_head)
        if weights:
            raise ValueError(f"unused weights: {sorted(weights)[:5]}")

    @staticmethod
    def _layer(weights: dict[str, np.ndarray], prefix: str) -> DecoderLayer:
        def linear(name: str) -> Linear:
            bias = weights.pop(f"{prefix}{name}.bias", None)
            weight = np.ascontiguousarray(weights.pop(f"{prefix}{name}.weight").T)  # HF stores [out, in]
            return Linear(paddle.to_tensor(weight), None if bias is None else paddle.to_tensor(bias))

        return DecoderLayer(
            input_norm=paddle.to_tensor(weights.pop(prefix + "input_layernorm.weight")),
            post_attention_norm=paddle.to_tensor(weights.pop(prefix + "post_attention_layernorm.weight")),
            projections={short: linear(name) for short, name in PROJECTIONS.items()},
        )

    def _norm(self, x: paddle.Tensor, weight: paddle.Tensor, residual: paddle.Tensor | None = None):
        """(rms_norm(x + residual) * weight, x + residual)."""
        summed = x if residual is None else x + residual
        # Plain ops: paddle's fused_rms_norm CPU kernel is AVX-512 code (SIGILL on AVX2-only CPUs).
        normed = summed * paddle.rsqrt(summed.square().mean(axis=-1, keepdim=True) + self.config.rms_norm_eps) * weight
        return normed, summed

    @paddle.no_grad()
    def forward(
        self,
        input_ids: paddle.Tensor,
        positions: paddle.Tensor,
        kv_cache: KVCache,
        attention: PagedAttentionBackend,
        attn_metadata: object,
    ) -> paddle.Tensor:
        """Hidden states [tokens, hidden] after the last layer (before the final norm)."""
        cfg = self.config
        query_rotation = self.rotary.rotation(positions, cfg.num_heads)
        key_rotation = self.rotary.rotation(positions, cfg.num_kv_heads)
        hidden, residual = F.embedding(input_ids, self.embed_tokens), None
        for layer, key_cache, value_cache in zip(self.layers, kv_cache.key_caches, kv_cache.value_caches):
            proj = layer.projections
            x, residual = self._norm(hidden, layer.input_norm, residual)
            query = query_rotation.apply(proj["q"](x).reshape([-1, cfg.num_heads, cfg.head_dim]))
            key = key_rotation.apply(proj["k"](x).reshape([-1, cfg.num_kv_heads, cfg.head_dim]))
            value = proj["v"](x).reshape([-1, cfg.num_kv_heads, cfg.head_dim])
            attention.write_kv(key_cache, value_cache, key, value, attn_metadata)
            attended = attention.attend(query, key_cache, value_cache, attn_metadata)
            x, residual = self._norm(proj["o"](attended), layer.post_attention_norm, residual)
            hidden = proj["down"](F.silu(proj["gate"](x)) * proj["up"](x))
        return hidden + residual

    @paddle.no_grad()
    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """Logits [rows, vocab] for the given rows of `forward`'s output."""
        return paddle.matmul(self._norm(hidden, self.norm)[0], self.lm_head, transpose_y=True)
