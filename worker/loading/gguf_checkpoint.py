"""A GGUF file as a checkpoint: config, tokenizer and tensors under Hugging Face names, as fp32 or as the
file's own quantized blocks."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from gguf.quants import dequantize

from worker.layers.weight_format import GgufBlocks, served_blocks
from worker.loading.gguf_file import read_gguf
from worker.loading.tokenizer import TokenizerInfo, tokenizer_from_gguf
from worker.loading.weight_layout import rows_in_half_rotation
from worker.models.config import GGUF_CONFIG_TENSORS, GGUF_TENSOR_VALUE_KEY, ModelConfig
from worker.models.registry import config_from_gguf, gguf_family

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_LAYER_FULL_NAMES = {"exp_probs_b.bias": "mlp.moe_statics.e_score_correction_bias"}  # ERNIE 4.5 MoE's
# The experts' matrices, stacked [experts, out, in] in one tensor each: read as one matrix per expert.
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, family_names: dict[str, str] | None = None) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; `family_names`: the family's own
    per-layer names, over Llama's."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = {**_LAYER_NAMES, **(family_names or {})}
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is not None and f"{match.group(2)}.{match.group(3)}" in _LAYER_FULL_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_FULL_NAMES[f'{match.group(2)}.{match.group(3)}']}"
    if match is None or match.group(2) not in names:
        raise KeyError(f"unexpected GGUF tensor {gguf_name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{names[part]}.{kind}"


def expert_names(gguf_name: str, num_experts: int) -> list[str] | None:
    """`blk.3.ffn_up_exps.weight` -> the Hugging Face names of its experts' matrices (`model.layers.3.mlp.experts.
    {e}.up_proj.weight`); None for a tensor of no experts."""
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _EXPERT_NAMES:
        return None
    layer, part, _ = match.groups()
    return [f"model.layers.{layer}.mlp.experts.{e}.{_EXPERT_NAMES[part]}.weight" for e in range(num_experts)]


class GGUFCheckpoint:
    """Reads one .gguf file; tensors are read one at a time."""

    def __init__(self, path: Path):
        self.path = path
        self._file = read_gguf(path)
        self.metadata = self._file.metadata
        self.family = gguf_family(self.metadata)
        config_values = {
            GGUF_TENSOR_VALUE_KEY.format(name=t.name): np.asarray(t.data, dtype=np.float32).reshape(-1).tolist()
            for t in self._file.tensors
            if t.name in GGUF_CONFIG_TENSORS
        }
        self.config: ModelConfig = config_from_gguf(
            {**self.metadata, **config_values}, {t.name for t in self._file.tensors}
        )
        self.tokenizer: TokenizerInfo = tokenizer_from_gguf(self.metadata)
        self.num_tensors = len(self._file.tensors)

    @property
    def name(self) -> str:
        return self.path.stem

    @property
    def tensor_bytes(self) -> int:
        """Bytes of every tensor as the file stores them."""
        return sum(int(tensor.n_bytes) for tensor in self._file.tensors)

    def tensors(self, keep_blocks: bool = False) -> Iterator[tuple[str, np.ndarray | GgufBlocks]]:
        """(Hugging Face name, tensor in HF layout) for every tensor of the file: fp32 arrays, or with
        `keep_blocks` the matrices of a type the custom GEMM serves as their blocks (copied out of the file)."""
        for tensor in self._file.tensors:
            if tensor.name in GGUF_CONFIG_TENSORS:  # read into the config (rope factors), not a weight
                continue
            shape = [int(dim) for dim in reversed(tensor.shape)]
            names = expert_names(tensor.name, shape[0]) if len(shape) == 3 else None
            if names is None:
                array = self._matrix(tensor, shape, keep_blocks)
                if self.family.gguf_rope_interleaved:
                    array = rows_in_half_rotation(tensor.name, array, self.config)
                yield hf_name(tensor.name, self.family.gguf_layer_names), array
                continue
            stacked = np.array(tensor.data).reshape(shape[0], shape[1], -1)
            for name, expert in zip(names, stacked):
                yield name, self._matrix_of(tensor.tensor_type, expert, shape[1:], keep_blocks)

    def _matrix(self, tensor, shape: list[int], keep_blocks: bool) -> np.ndarray | GgufBlocks:
        if len(shape) == 2:
            return self._matrix_of(tensor.tensor_type, np.array(tensor.data).reshape(shape[0], -1), shape, keep_blocks)
        return np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)

    @staticmethod
    def _matrix_of(tensor_type, rows: np.ndarray, shape: list[int], keep_blocks: bool) -> np.ndarray | GgufBlocks:
        """A matrix [out, in] of a file's rows (one per output feature, as stored): its blocks where kept and served,
        else its fp32 values."""
        blocks = served_blocks(tensor_type, rows, shape[1]) if keep_blocks else None
        if blocks is not None:
            return blocks
        return np.asarray(dequantize(rows, tensor_type), dtype=np.float32).reshape(shape)
