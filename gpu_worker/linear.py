"""The model's linear layers, y = x @ W (+ bias), on the chosen kernel path.

The pure-Paddle path calls F.linear on an [in, out] weight (the reference and fallback); the custom
path packs the weight once at load into the bs_linear op's 16-column panels. Projections that read
the same input are fused into one weight (q|k|v, gate|up) on both paths: one GEMM instead of several.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import paddle
import paddle.nn.functional as F

if TYPE_CHECKING:
    from gpu_worker.kernels import Kernels


@dataclass(frozen=True)
class PaddleLinear:
    weight: paddle.Tensor  # [in, out]
    bias: paddle.Tensor | None

    @property
    def in_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: paddle.Tensor) -> paddle.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass(frozen=True)
class PackedLinear:
    ops: ModuleType
    packed: paddle.Tensor  # [out panels, in, 16] from bs_linear_pack
    bias: paddle.Tensor | None
    out_features: int
    avx512: bool

    @property
    def in_features(self) -> int:
        return self.packed.shape[1]

    def __call__(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.ops.bs_linear(x, self.packed, self.bias, self.out_features, self.avx512)


Linear = PaddleLinear | PackedLinear


@dataclass(frozen=True)
class TiedLmHead:
    """Logits through the input embedding [vocab, hidden] itself (transposed in the matmul), not a copy."""

    embedding: paddle.Tensor

    @property
    def in_features(self) -> int:
        return self.embedding.shape[1]

    def __call__(self, x: paddle.Tensor) -> paddle.Tensor:
        return paddle.matmul(x, self.embedding, transpose_y=True)


def fused_linear(kernels: Kernels, weights: list[np.ndarray], biases: list[np.ndarray | None]) -> Linear:
    """One layer computing every [out_i, in] weight (Hugging Face's layout) side by side: y = y_0 | y_1 | ..."""
    weight = np.ascontiguousarray(np.concatenate(weights, axis=0).T, dtype=np.float32)
    bias = None
    if any(b is not None for b in biases):
        bias = np.concatenate([np.zeros(w.shape[0], np.float32) if b is None else b for w, b in zip(weights, biases)])
    return linear(kernels, weight, bias)


def linear(kernels: Kernels, weight: np.ndarray, bias: np.ndarray | None) -> Linear:
    """The layer for an [in, out] weight on `kernels`' path."""
    bias_tensor = None if bias is None else paddle.to_tensor(np.asarray(bias, dtype=np.float32))
    if kernels.name != "custom":
        return PaddleLinear(paddle.to_tensor(weight), bias_tensor)
    packed = kernels.ops.bs_linear_pack(paddle.to_tensor(weight))
    return PackedLinear(kernels.ops, packed, bias_tensor, weight.shape[1], kernels.avx512)


def lm_head(kernels: Kernels, weight: np.ndarray | None, embedding: paddle.Tensor) -> Linear | TiedLmHead:
    """The output projection: the untied [vocab, hidden] weight, or the embedding when tied.

    The custom path packs a transposed copy of a tied embedding (memory for speed).
    """
    if weight is None and kernels.name != "custom":
        return TiedLmHead(embedding)
    source = embedding.numpy() if weight is None else weight
    return linear(kernels, np.ascontiguousarray(source.T), None)
