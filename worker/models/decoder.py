"""The decoder of every family (models/registry.py) over a flat batch of tokens with a paged KV cache: Llama's
layer, with the variations a family's config describes (models/config.py: norms before, around or after each
sublayer, q/k norms, GeGLU, multipliers, per-layer rotary, windows and soft-caps, a mixture of experts in place of
the MLP: layers/experts.py).

Projections that read the same input are one GEMM (q|k|v, gate|up: layers/linear.py), and
residual adds are fused into the RMS norms. Weights are held in the precision's formats
(layers/precision.py); on a CPU norms stay fp32, on a GPU every tensor but the rotary tables takes
the model's dtype (host/model_to_device.py); every sum is fp32. A Llama layer is written twice: op by op here,
the reference, and in one C++ op (models/llama_decoder_stack.py), which is tested against it and serves every
family whose layers are Llama's (ModelConfig.is_llama_layer); the others run op by op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import paddle

from worker.attention.backend import AttentionBackend, LayerAttention
from worker.attention.kv_cache import KVCache
from worker.kernels.protocol import Kernels
from worker.layers.activation import gelu_tanh_and_mul
from worker.layers.experts import MixtureOfExperts, experts, router
from worker.layers.linear import Linear, Weight, embedding_and_lm_head, fused_linear
from worker.layers.precision import Precision
from worker.layers.rotary import RotaryEmbedding
from worker.models.config import ModelConfig
from worker.models.llama_decoder_stack import step_layout

if TYPE_CHECKING:
    from worker.inputs.model_inputs import ModelInputs


@dataclass(frozen=True)
class DecoderLayer:
    input_norm: paddle.Tensor | None  # before attention (None: norms after the sublayers)
    post_attention_norm: paddle.Tensor  # "pre": before the MLP; otherwise on the attention's output
    qkv: Linear  # output q | k | v
    o: Linear
    gate_up: Linear | None  # output gate | up (None: a mixture of experts without shared experts)
    down: Linear | None
    pre_feedforward_norm: paddle.Tensor | None = None  # "sandwich": before the MLP
    post_feedforward_norm: paddle.Tensor | None = None  # "sandwich", "post": on the MLP's output
    q_norm: paddle.Tensor | None = None  # [head_dim] per head, or [heads * head_dim] over the projection
    k_norm: paddle.Tensor | None = None
    moe: MixtureOfExperts | None = None  # in place of the MLP, or beside it (the MLP: the shared experts)

    @property
    def linears(self) -> tuple[Linear, ...]:
        return tuple(linear for linear in (self.qkv, self.o, self.gate_up, self.down) if linear is not None)

    @property
    def norms(self) -> list[paddle.Tensor]:
        found = (self.input_norm, self.post_attention_norm, self.pre_feedforward_norm, self.post_feedforward_norm)
        return [norm for norm in (*found, self.q_norm, self.k_norm) if norm is not None]


class CausalDecoder:
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
        self.layer_attention = self._layer_attention(max_positions)
        self.layers = [self._load_layer(weights, i) for i in range(config.num_layers)]
        self.norm = paddle.to_tensor(weights.pop("model.norm.weight"))
        self.embed_tokens, self.lm_head = embedding_and_lm_head(
            kernels, weights.pop("model.embed_tokens.weight"), weights.pop("lm_head.weight", None), precision
        )
        if weights:
            raise ValueError(f"unused weights: {sorted(weights)[:5]}")

    def _layer_attention(self, max_positions: int) -> list[LayerAttention] | None:
        """Each layer's rotary, window, scale and soft-cap; None where every layer's are the model-wide defaults."""
        config = self.config
        if not (config.layer_ropes or config.sliding_windows or config.attention_scale or config.attention_softcap):
            return None
        rotaries = {repr(config.rope): self.rotary}
        layers = []
        for i in range(config.num_layers):
            rope = config.layer_rope(i)
            if repr(rope) not in rotaries:
                rotaries[repr(rope)] = RotaryEmbedding(rope, config.head_dim, max_positions)
            layers.append(
                LayerAttention(
                    rotaries[repr(rope)], config.sliding_window(i), config.attention_scale, config.attention_softcap
                )
            )
        return layers

    def _load_layer(self, weights: dict[str, Weight], index: int) -> DecoderLayer:
        prefix = f"model.layers.{index}."

        def linear(*names: str) -> Linear:
            """The projections `names` (weights [out, in] as Hugging Face stores them) as one layer."""
            found = [weights.pop(f"{prefix}{name}.weight") for name in names]
            biases = [weights.pop(f"{prefix}{name}.bias", None) for name in names]
            return fused_linear(self.kernels, found, biases, self.precision)

        def norm(name: str) -> paddle.Tensor | None:
            weight = weights.pop(f"{prefix}{name}.weight", None)
            return None if weight is None else paddle.to_tensor(weight)

        fused_qkv = f"{prefix}self_attn.qkv_proj.weight" in weights  # Phi-3 stores them fused
        fused_gate_up = f"{prefix}mlp.gate_up_proj.weight" in weights
        moe, mlp = None, "mlp."
        if self.config.is_moe_layer(index):
            moe, mlp = self._load_moe(weights, prefix), "mlp.shared_experts."
        has_mlp = fused_gate_up or f"{prefix}{mlp}gate_proj.weight" in weights
        return DecoderLayer(
            input_norm=norm("input_layernorm"),
            post_attention_norm=norm("post_attention_layernorm"),
            qkv=linear("self_attn.qkv_proj")
            if fused_qkv
            else linear("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            o=linear("self_attn.o_proj"),
            gate_up=(linear("mlp.gate_up_proj") if fused_gate_up else linear(f"{mlp}gate_proj", f"{mlp}up_proj"))
            if has_mlp
            else None,
            down=linear(f"{mlp}down_proj") if has_mlp else None,
            pre_feedforward_norm=norm("pre_feedforward_layernorm"),
            post_feedforward_norm=norm("post_feedforward_layernorm"),
            q_norm=norm("self_attn.q_norm"),
            k_norm=norm("self_attn.k_norm"),
            moe=moe,
        )

    def _load_moe(self, weights: dict[str, Weight], prefix: str) -> MixtureOfExperts:
        """A layer's router and experts (`mlp.gate`, `mlp.experts.{e}.*`: Hugging Face's names)."""
        config = self.config

        def expert_weights(name: str) -> list[Weight]:
            return [weights.pop(f"{prefix}mlp.experts.{e}.{name}.weight") for e in range(config.num_experts)]

        correction = weights.pop(f"{prefix}mlp.moe_statics.e_score_correction_bias", None)
        layer_router = router(
            weights.pop(f"{prefix}mlp.gate.weight"),
            correction,
            config.num_experts_per_token,
            config.normalize_expert_weights,
            config.expert_weights_sum_min,
        )
        gates, ups, downs = expert_weights("gate_proj"), expert_weights("up_proj"), expert_weights("down_proj")
        return MixtureOfExperts(layer_router, experts(self.kernels, gates, ups, downs, self.precision))

    def weight_tensors(self) -> list[paddle.Tensor]:
        """The tensors of the weights the model holds (packed matrices, embedding, norms, biases), each once."""
        tensors = [self.norm, *self.embed_tokens.tensors(), *self.lm_head.tensors()]
        for layer in self.layers:
            tensors += layer.norms
            tensors += [tensor for linear in layer.linears for tensor in linear.tensors()]
            tensors += layer.moe.tensors() if layer.moe is not None else []
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
        if self.config.embedding_multiplier != 1.0:
            hidden = hidden * self.config.embedding_multiplier
        for i, (layer, key_cache, value_cache) in enumerate(
            zip(self.layers, kv_cache.key_caches, kv_cache.value_caches)
        ):
            caches = key_cache, value_cache, attention, inputs.attention_metadata
            hidden, residual = self._layer_op_by_op(i, layer, hidden, residual, caches)
        return self._norm(hidden, self.norm, residual)[0]

    def _attend(self, index: int, layer: DecoderLayer, x: paddle.Tensor, caches: tuple) -> paddle.Tensor:
        """Layer `index`'s attention output (before o) for its input x: q/k norms, rope, cache write, attention."""
        key_cache, value_cache, attention, metadata = caches
        layer_attention = None if self.layer_attention is None else self.layer_attention[index]
        qkv = self._qk_normed(layer, layer.qkv(x))
        return attention.attend_qkv(qkv, key_cache, value_cache, metadata, layer_attention)

    def _layer_op_by_op(self, index: int, layer: DecoderLayer, hidden, residual, caches: tuple):
        """One decoder layer op by op: (hidden, residual) after it, the stream being their sum; `caches`: its K and
        V caches, the attention and the step's metadata. The reference bs_decoder_stack is tested against."""
        placement = self.config.norm_placement
        if placement == "post":  # OLMo 2: stream + norm(sublayer(stream))
            stream = hidden if residual is None else hidden + residual
            attended = self._norm(layer.o(self._attend(index, layer, stream, caches)), layer.post_attention_norm)[0]
            stream = stream + self._scaled(attended)
            return self._scaled(self._norm(self._mlp(layer, stream), layer.post_feedforward_norm)[0]), stream
        x, residual = self._norm(hidden, layer.input_norm, residual)
        attended = self._scaled(layer.o(self._attend(index, layer, x, caches)))
        if placement == "sandwich":  # Gemma: norms on each sublayer's output too
            attended = self._norm(attended, layer.post_attention_norm)[0]
            x, residual = self._norm(attended, layer.pre_feedforward_norm, residual)
            return self._norm(self._mlp(layer, x), layer.post_feedforward_norm)[0], residual
        x, residual = self._norm(attended, layer.post_attention_norm, residual)
        return self._scaled(self._mlp(layer, x)), residual

    def _mlp(self, layer: DecoderLayer, x: paddle.Tensor) -> paddle.Tensor:
        """The MLP's output; in a mixture of experts' layer the experts', plus the shared experts' where it has them."""
        if layer.moe is None:
            return self._dense_mlp(layer, x)
        routed = layer.moe(x, self.kernels.silu_and_mul)
        return routed if layer.gate_up is None else routed + self._dense_mlp(layer, x)

    def _dense_mlp(self, layer: DecoderLayer, x: paddle.Tensor) -> paddle.Tensor:
        gate_up = layer.gate_up(x)
        if self.config.activation == "gelu_tanh":
            return layer.down(gelu_tanh_and_mul(gate_up))
        return layer.down(self.kernels.silu_and_mul(gate_up))

    def _scaled(self, sublayer_output: paddle.Tensor) -> paddle.Tensor:
        """A sublayer's output times the residual multiplier (Granite)."""
        multiplier = self.config.residual_multiplier
        return sublayer_output if multiplier == 1.0 else sublayer_output * multiplier

    def _qk_normed(self, layer: DecoderLayer, qkv: paddle.Tensor) -> paddle.Tensor:
        """q|k|v with q and k RMS-normed, per head or over the whole projection, where the family norms them."""
        if layer.q_norm is None:
            return qkv
        config = self.config
        q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        query, key, value = paddle.split(qkv, [q_width, kv_width, kv_width], axis=-1)
        if config.qk_norm == "head":
            query = self._norm(query.reshape([-1, config.head_dim]), layer.q_norm)[0].reshape([-1, q_width])
            key = self._norm(key.reshape([-1, config.head_dim]), layer.k_norm)[0].reshape([-1, kv_width])
        else:
            query, key = self._norm(query, layer.q_norm)[0], self._norm(key, layer.k_norm)[0]
        return paddle.concat([query, key, value], axis=-1)

    @paddle.no_grad()
    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """Logits [rows, vocab] for the given rows of `forward`'s output."""
        logits = self.lm_head(hidden)
        if self.config.logit_multiplier != 1.0:
            logits = logits * self.config.logit_multiplier
        if (cap := self.config.final_logit_softcap) is not None:
            logits = paddle.tanh(logits / cap) * cap
        return logits
