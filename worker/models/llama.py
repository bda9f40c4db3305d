"""Llama-family decoder (Llama, SmolLM2, Qwen2) over a flat batch of tokens with a paged KV cache.

Projections that read the same input are one GEMM (q|k|v, gate|up: layers/linear.py), and
residual adds are fused into the RMS norms. Weights are held in the precision's formats
(layers/precision.py); on a CPU norms stay fp32, on a GPU every tensor but the rotary tables takes
the model's dtype (host/model_to_device.py); every sum is fp32. The layer is written twice: op by op here, the
reference, and in one C++ op (models/llama_decoder_stack.py), which is tested against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import paddle

from worker.attention.backend import AttentionBackend
from worker.attention.kv_cache import KVCache
from worker.kernels.protocol import Kernels
from worker.layers.linear import Linear, Weight, embedding_and_lm_head, fused_linear
from worker.layers.precision import Precision
from worker.layers.rotary import RotaryEmbedding
from worker.models.config import ModelConfig
from worker.models.llama_decoder_stack import step_layout

if TYPE_CHECKING:
    from worker.inputs.model_inputs import ModelInputs


@dataclass(frozen=True)
class DecoderLayer:
    input_norm: paddle.Tensor
    post_attention_norm: paddle.Tensor
    qkv: Linear  # output q | k | v
    o: Linear
    gate_up: Linear  # output gate | up
    down: Linear

    @property
    def linears(self) -> tuple[Linear, ...]:
        return self.qkv, self.o, self.gate_up, self.down


class LlamaForCausalLM:
    """The decoder stack; `forward` fills the KV cache and returns hidden states per token."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, Weight],
        max_positions: int,
        kernels: Kernels,
        precision: Precision,
    ):
        self.config = config
        self.kernels = kernels  # norms, activation (and, through the runner, attention) of the chosen path
        self.precision = precision
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, max_positions)
        self.layers = [self._load_layer(weights, f"model.layers.{i}.") for i in range(config.num_layers)]
        self.norm = paddle.to_tensor(weights.pop("model.norm.weight"))
        self.embed_tokens, self.lm_head = embedding_and_lm_head(
            kernels, weights.pop("model.embed_tokens.weight"), weights.pop("lm_head.weight", None), precision
        )
        if weights:
            raise ValueError(f"unused weights: {sorted(weights)[:5]}")

    def _load_layer(self, weights: dict[str, Weight], prefix: str) -> DecoderLayer:
        def linear(*names: str) -> Linear:
            """The projections `names` (weights [out, in] as Hugging Face stores them) as one layer."""
            found = [weights.pop(f"{prefix}{name}.weight") for name in names]
            biases = [weights.pop(f"{prefix}{name}.bias", None) for name in names]
            return fused_linear(self.kernels, found, biases, self.precision)

        return DecoderLayer(
            input_norm=paddle.to_tensor(weights.pop(prefix + "input_layernorm.weight")),
            post_attention_norm=paddle.to_tensor(weights.pop(prefix + "post_attention_layernorm.weight")),
            qkv=linear("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            o=linear("self_attn.o_proj"),
            gate_up=linear("mlp.gate_proj", "mlp.up_proj"),
            down=linear("mlp.down_proj"),
        )

    def weight_tensors(self) -> list[paddle.Tensor]:
        """The tensors of the weights the model holds (packed matrices, embedding, norms, biases), each once."""
        tensors = [self.norm, *self.embed_tokens.tensors(), *self.lm_head.tensors()]
        for layer in self.layers:
            tensors += [layer.input_norm, layer.post_attention_norm]
            tensors += [tensor for linear in layer.linears for tensor in linear.tensors()]
        return list({id(tensor): tensor for tensor in tensors}.values())  # a tied table counts once

    def weight_bytes(self) -> int:
        """Bytes of the weights the model holds."""
        return sum(int(tensor.numel()) * tensor.element_size() for tensor in self.weight_tensors())

    def _norm(self, x: paddle.Tensor, weight: paddle.Tensor, residual: paddle.Tensor | None = None):
        """(rms_norm(x + residual) * weight, x + residual)."""
        return self.kernels.add_rms_norm(x, weight, residual, self.config.rms_norm_eps)

    @paddle.no_grad()
    def forward(self, inputs: ModelInputs, kv_cache: KVCache, attention: AttentionBackend) -> paddle.Tensor:
        """Hidden states [tokens, hidden] after the last layer and the final norm (compute_logits' input)."""
        fused = self.kernels.fused_stack(attention, self.config)
        if fused is not None:  # the embedding lookup, the layers and the final norm in one op
            return fused(self, kv_cache, step_layout(inputs))
        hidden, residual = self.embed_tokens(inputs.input_ids), None
        for layer, key_cache, value_cache in zip(self.layers, kv_cache.key_caches, kv_cache.value_caches):
            hidden, residual = self._layer_op_by_op(
                layer, hidden, residual, key_cache, value_cache, attention, inputs.attention_metadata
            )
        return self._norm(hidden, self.norm, residual)[0]

    def _layer_op_by_op(self, layer: DecoderLayer, hidden, residual, key_cache, value_cache, attention, attn_metadata):
        """One decoder layer op by op: (hidden, residual) after it. The reference bs_decoder_stack is tested against."""
        x, residual = self._norm(hidden, layer.input_norm, residual)
        qkv = layer.qkv(x)
        attended = attention.attend_qkv(qkv, key_cache, value_cache, attn_metadata)  # rope, cache write, attention
        x, residual = self._norm(layer.o(attended), layer.post_attention_norm, residual)
        return layer.down(self.kernels.silu_and_mul(layer.gate_up(x))), residual

    @paddle.no_grad()
    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """Logits [rows, vocab] for the given rows of `forward`'s output."""
        return self.lm_head(hidden)
