"""The model's linear layers, y = x @ W (+ bias), and its token embedding, on the chosen kernel path.

The pure-Paddle path (the reference and fallback) and the CUDA kernels ("cuda": Paddle's matmul, cuBLAS)
call F.linear on an [in, out] weight made in fp32; on a GPU the runner moves it there in the model's
dtype (host/model_to_device.py). The custom CPU path packs every weight once at load into the
bs_linear op's 16-column panels, in the format the precision picks (fp32, bf16, int8 with a scale per
output feature, or a GGUF file's own blocks). A tied embedding is the packed lm_head itself: the lookup
reads its columns back, so the table is held once. Projections that read the same input are fused into
one weight (q|k|v, gate|up) on every path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import paddle
import paddle.nn.functional as F

from worker.layers.precision import Precision
from worker.layers.weight_format import GgufBlocks, WeightFormat, dense, quantize_int8

if TYPE_CHECKING:
    from worker.kernels.cpu import CustomKernels
    from worker.kernels.protocol import Kernels

Weight = np.ndarray | GgufBlocks  # [out_features, in_features], Hugging Face's layout


@dataclass(frozen=True)
class PaddleLinear:
    weight: paddle.Tensor  # [in, out]
    bias: paddle.Tensor | None

    @property
    def in_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: paddle.Tensor) -> paddle.Tensor:
        return F.linear(x, self.weight, self.bias)

    def tensors(self) -> list[paddle.Tensor]:
        return [t for t in (self.weight, self.bias) if t is not None]


@dataclass(frozen=True)
class PackedLinear:
    ops: ModuleType
    packed: paddle.Tensor  # uint8 [out panels, panel bytes] from a bs_linear_pack* op
    bias: paddle.Tensor | None
    in_features: int
    out_features: int
    format: WeightFormat
    isa: int  # the ops' isa bits

    def __call__(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.ops.bs_linear(x, self.packed, self.bias, self.out_features, int(self.format), self.isa)

    def tensors(self) -> list[paddle.Tensor]:
        return [t for t in (self.packed, self.bias) if t is not None]

    def columns(self, ids: paddle.Tensor) -> paddle.Tensor:
        """W[:, ids].T in fp32: [len(ids), in_features] (the rows of a tied embedding)."""
        return self.ops.bs_linear_columns(self.packed, ids, self.in_features, self.out_features, int(self.format))


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

    def tensors(self) -> list[paddle.Tensor]:
        return [self.embedding]


@dataclass(frozen=True)
class PaddleEmbedding:
    table: paddle.Tensor  # [vocab, hidden] fp32 (on a GPU, the model's dtype)

    def __call__(self, ids: paddle.Tensor) -> paddle.Tensor:
        return F.embedding(ids, self.table)

    def tensors(self) -> list[paddle.Tensor]:
        return [self.table]


@dataclass(frozen=True)
class PackedEmbedding:
    weight: PackedLinear  # the table transposed: [hidden, vocab], an lm_head's layout

    def __call__(self, ids: paddle.Tensor) -> paddle.Tensor:
        return self.weight.columns(ids)

    def tensors(self) -> list[paddle.Tensor]:
        return self.weight.tensors()


Embedding = PaddleEmbedding | PackedEmbedding


def fused_linear(
    kernels: Kernels, weights: list[Weight], biases: list[np.ndarray | None], precision: Precision
) -> Linear:
    """One layer computing every weight side by side: y = y_0 | y_1 | ..."""
    bias = None
    if any(b is not None for b in biases):
        bias = np.concatenate(
            [np.zeros(_out_features(w), np.float32) if b is None else b for w, b in zip(weights, biases)]
        )
    same_blocks = all(isinstance(w, GgufBlocks) and w.format == weights[0].format for w in weights)
    if same_blocks and kernels.name == "custom":
        fused = GgufBlocks(weights[0].format, np.concatenate([w.rows for w in weights]), weights[0].in_features)
    else:
        fused = np.concatenate([dense(w) for w in weights], axis=0)
    return linear(kernels, fused, bias, precision)


def linear(kernels: Kernels, weight: Weight, bias: np.ndarray | None, precision: Precision) -> Linear:
    """The layer for a weight [out, in] on `kernels`' path."""
    bias_tensor = None if bias is None else paddle.to_tensor(np.asarray(bias, dtype=np.float32))
    if kernels.name != "custom":
        return PaddleLinear(paddle.to_tensor(np.ascontiguousarray(dense(weight).T)), bias_tensor)
    return _packed(kernels, weight, bias_tensor, precision)


def embedding_and_lm_head(
    kernels: Kernels, embedding: Weight, lm_head: Weight | None, precision: Precision
) -> tuple[Embedding, Linear | TiedLmHead]:
    """The token embedding [vocab, hidden] and the output projection (tied to it when `lm_head` is None)."""
    if kernels.name != "custom":
        table = paddle.to_tensor(dense(embedding))
        head = TiedLmHead(table) if lm_head is None else linear(kernels, lm_head, None, precision)
        return PaddleEmbedding(table), head
    # The lm_head stays on the kernels' own GEMMs (no oneDNN route: its 49152-column shape is not among the ones
    # layers/gemm_route.py times, and on the Zen 4 oneDNN multiplied it at 0.61-0.87x the kernels' rate).
    own_gemms = replace(kernels.isa, onednn_rows=0).bits
    packed_table = _packed(kernels, embedding, None, precision, own_gemms)
    head = packed_table if lm_head is None else _packed(kernels, lm_head, None, precision, own_gemms)
    return PackedEmbedding(packed_table), head


def _packed(
    kernels: CustomKernels, weight: Weight, bias: paddle.Tensor | None, precision: Precision, isa: int | None = None
) -> PackedLinear:
    """The packed layer, on the ops' `isa` bits (the kernels' own by default)."""
    weight_format = precision.weight_format(weight)
    ops = kernels.ops
    if weight_format.is_gguf_block:
        packed = ops.bs_linear_pack_gguf(paddle.to_tensor(weight.rows), int(weight_format), weight.in_features)
    elif weight_format == WeightFormat.INT8:
        q, scales = quantize_int8(np.ascontiguousarray(dense(weight).T))
        packed = ops.bs_linear_pack_int8(paddle.to_tensor(q), paddle.to_tensor(scales))
    else:
        packed = ops.bs_linear_pack(paddle.to_tensor(np.ascontiguousarray(dense(weight).T)), int(weight_format))
    out_features, in_features = _out_features(weight), _in_features(weight)
    return PackedLinear(
        ops, packed, bias, in_features, out_features, weight_format, kernels.isa.bits if isa is None else isa
    )


def _out_features(weight: Weight) -> int:
    return weight.out_features if isinstance(weight, GgufBlocks) else weight.shape[0]


def _in_features(weight: Weight) -> int:
    return weight.in_features if isinstance(weight, GgufBlocks) else weight.shape[1]
