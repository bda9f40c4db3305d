"""A mixture of experts' MLP: the router picks each token's experts and their weights, the experts (each a
SwiGLU MLP) compute the tokens routed to them, and each token gets the weighted sum of its experts' outputs.

On the pure-Paddle path (the reference and fallback, and the GPU's) the experts are a loop over the experts the
step chose, Paddle ops on each one's tokens, as transformers computes them. On the custom CPU path every
expert's gate|up and down are packed once in the bs_linear op's panels, stacked in one buffer per projection, and
one bs_moe_experts call gathers each expert's tokens, runs them through the packed GEMM and scatters the weighted
sum back (custom_ops/cpu/moe_ops.cc).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import paddle
import paddle.nn.functional as F

from worker.layers.linear import Linear, PackedLinear, Weight, fused_linear, linear
from worker.layers.precision import Precision
from worker.layers.weight_format import WeightFormat, dense

if TYPE_CHECKING:
    from worker.kernels.protocol import Kernels


@dataclass(frozen=True)
class Router:
    """Each token's top k experts by softmax probability (plus a correction where the family has one: the choice
    only), weighted by their probabilities, renormalised to sum 1 where `normalize` (the sum floored at `sum_min`)."""

    weight: paddle.Tensor  # [hidden, experts] fp32
    correction: paddle.Tensor | None  # [experts], added to the probabilities to choose (ERNIE 4.5's moe_statics)
    top_k: int
    normalize: bool
    sum_min: float

    def __call__(self, x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        """(expert ids int64 [tokens, top_k], their weights fp32 [tokens, top_k])."""
        logits = paddle.matmul(x.astype(self.weight.dtype), self.weight).astype("float32")
        probabilities = F.softmax(logits, axis=-1)
        scores = probabilities if self.correction is None else probabilities + self.correction.astype("float32")
        expert_ids = paddle.topk(scores, self.top_k, axis=-1)[1]
        weights = paddle.take_along_axis(probabilities, expert_ids, axis=-1)
        if self.normalize:
            weights = weights / paddle.clip(weights.sum(axis=-1, keepdim=True), min=self.sum_min)
        return expert_ids, weights

    def tensors(self) -> list[paddle.Tensor]:
        return [t for t in (self.weight, self.correction) if t is not None]


@dataclass(frozen=True)
class PaddleExperts:
    """One gate|up and one down layer per expert; a step runs the experts its tokens chose, one after another."""

    gate_ups: tuple[Linear, ...]
    downs: tuple[Linear, ...]

    def __call__(
        self,
        x: paddle.Tensor,
        expert_ids: paddle.Tensor,
        weights: paddle.Tensor,
        silu_and_mul: Callable[[paddle.Tensor], paddle.Tensor],
    ) -> paddle.Tensor:
        out = paddle.zeros_like(x)
        chosen = expert_ids.numpy()
        for expert in np.unique(chosen):
            tokens, slots = np.nonzero(chosen == expert)
            token_index = paddle.to_tensor(tokens, place=x.place)
            expert_out = self.downs[expert](silu_and_mul(self.gate_ups[expert](paddle.gather(x, token_index))))
            chosen_slots = paddle.to_tensor(tokens * chosen.shape[1] + slots, place=x.place)
            token_weights = paddle.gather(weights.flatten(), chosen_slots).astype(x.dtype)
            out = paddle.index_add(out, token_index, 0, expert_out * token_weights.unsqueeze(-1))
        return out

    def tensors(self) -> list[paddle.Tensor]:
        return [t for layer in (*self.gate_ups, *self.downs) for t in layer.tensors()]


@dataclass(frozen=True)
class PackedExperts:
    """Every expert's gate|up and down packed (bs_linear_pack*) and stacked: one buffer per projection."""

    ops: ModuleType
    gate_up: paddle.Tensor  # uint8 [experts * panels of gate|up, panel bytes]
    down: paddle.Tensor  # uint8 [experts * panels of down, panel bytes]
    num_experts: int
    intermediate_size: int
    gate_up_format: WeightFormat
    down_format: WeightFormat
    isa: int  # the ops' isa bits

    def __call__(
        self,
        x: paddle.Tensor,
        expert_ids: paddle.Tensor,
        weights: paddle.Tensor,
        silu_and_mul: Callable[[paddle.Tensor], paddle.Tensor] | None = None,
    ) -> paddle.Tensor:
        return self.ops.bs_moe_experts(
            x,
            expert_ids,
            weights,
            self.gate_up,
            self.down,
            self.num_experts,
            self.intermediate_size,
            int(self.gate_up_format),
            int(self.down_format),
            self.isa,
        )

    def tensors(self) -> list[paddle.Tensor]:
        return [self.gate_up, self.down]


Experts = PaddleExperts | PackedExperts


@dataclass(frozen=True)
class MixtureOfExperts:
    router: Router
    experts: Experts

    def __call__(self, x: paddle.Tensor, silu_and_mul: Callable[[paddle.Tensor], paddle.Tensor]) -> paddle.Tensor:
        expert_ids, weights = self.router(x)
        return self.experts(x, expert_ids, weights, silu_and_mul)

    def tensors(self) -> list[paddle.Tensor]:
        return [*self.router.tensors(), *self.experts.tensors()]


def experts(
    kernels: Kernels, gates: list[Weight], ups: list[Weight], downs: list[Weight], precision: Precision
) -> Experts:
    """The experts of [out, in] weights (Hugging Face's layout), one of each list per expert, on `kernels`' path."""
    gate_ups = [fused_linear(kernels, [gate, up], [None, None], precision) for gate, up in zip(gates, ups)]
    down_layers = [linear(kernels, down, None, precision) for down in downs]
    if kernels.name != "custom":
        return PaddleExperts(tuple(gate_ups), tuple(down_layers))
    return PackedExperts(
        kernels.ops,
        _stacked(gate_ups),
        _stacked(down_layers),
        len(gate_ups),
        gate_ups[0].out_features // 2,
        gate_ups[0].format,
        down_layers[0].format,
        kernels.isa.bits,
    )


def router(weight: Weight, correction: np.ndarray | None, config_top_k: int, normalize: bool, sum_min: float) -> Router:
    """The router of a [experts, hidden] weight; `correction`: ERNIE 4.5's per-expert term of the choice."""
    correction_tensor = None if correction is None else paddle.to_tensor(np.asarray(correction, np.float32).reshape(-1))
    return Router(
        paddle.to_tensor(np.ascontiguousarray(dense(weight).T)), correction_tensor, config_top_k, normalize, sum_min
    )


def _stacked(layers: list[PackedLinear]) -> paddle.Tensor:
    if len({layer.format for layer in layers}) != 1:
        raise ValueError(f"experts of one projection in several formats: {sorted({layer.format for layer in layers})}")
    if any(layer.bias is not None for layer in layers):
        raise ValueError("experts with biases")
    return paddle.concat([layer.packed for layer in layers], axis=0)
