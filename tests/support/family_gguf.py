"""A tiny family model's Hugging Face folder written as a GGUF file the way llama.cpp's converter writes it: its
tensor names (gguf's own TensorNameMap), q/k rows permuted for the architectures whose rotary pairs are (2i, 2i+1)
in llama.cpp and (i, i + d/2) in the folder, Gemma's norms stored as 1 + w, a mixture's experts stacked in one
tensor per layer and projection ([experts, out, in]), the family's keys, and the SmolLM2 GGUF's tokenizer. Weights
stay float32."""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from safetensors.numpy import load_file

PERMUTED_ARCHITECTURES = ("llama", "granite", "smollm3")  # convert_hf_to_gguf.py's LlamaModel.permute
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")  # their converter adds 1 to every norm weight
# model_type -> general.architecture, where they differ (llama.cpp writes Mixtral as llama)
GGUF_ARCHITECTURE = {
    "gemma3_text": "gemma3",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",
    "ernie4_5_moe": "ernie4_5-moe",
}
MODEL_ARCH = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
EXPERT_TENSORS = {  # an expert's matrix in the folder -> llama.cpp's stacked tensor
    "gate_proj": gguf.MODEL_TENSOR.FFN_GATE_EXP,
    "w1": gguf.MODEL_TENSOR.FFN_GATE_EXP,
    "up_proj": gguf.MODEL_TENSOR.FFN_UP_EXP,
    "w3": gguf.MODEL_TENSOR.FFN_UP_EXP,
    "down_proj": gguf.MODEL_TENSOR.FFN_DOWN_EXP,
    "w2": gguf.MODEL_TENSOR.FFN_DOWN_EXP,
}
HF_PART = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Mixtral's names for an expert's matrices
CORRECTION = re.compile(r"model\.layers\.(\d+)\.mlp\.moe_statics\.e_score_correction_bias")
TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
)


def permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rows (i, i + d/2) interleaved to (2i, 2i+1)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_family_gguf(
    folder: Path, path: Path, tokenizer_gguf: Path, expert_types: dict[str, GGMLQuantizationType] | None = None
) -> None:
    """The folder's weights as llama.cpp writes the family: float32 tensors, a mixture's experts stacked per layer
    and projection, each stacked part quantized to `expert_types[part]` (gate_proj, up_proj, down_proj) where given."""
    expert_types = expert_types or {}
    config = json.loads((folder / "config.json").read_text())
    arch = GGUF_ARCHITECTURE.get(config["model_type"], config["model_type"])
    num_layers = config["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(path), arch)
    _write_keys(writer, arch, config)
    _copy_tokenizer(writer, tokenizer_gguf)
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") == "longrope":  # its factors are tensors in a GGUF file
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    names = gguf.get_tensor_name_map(MODEL_ARCH[arch], num_layers)
    experts: dict[str, dict[int, np.ndarray]] = {}
    stacked_types: dict[str, GGMLQuantizationType | None] = {}
    for hf_name, array in load_file(folder / "model.safetensors").items():
        array = array.astype(np.float32)
        if expert := EXPERT.fullmatch(hf_name):
            layer, index, part = expert.groups()
            stacked_name = gguf.TENSOR_NAMES[EXPERT_TENSORS[part]].format(bid=layer) + ".weight"
            experts.setdefault(stacked_name, {})[int(index)] = array
            stacked_types[stacked_name] = expert_types.get(HF_PART.get(part, part))
            continue
        if correction := CORRECTION.fullmatch(hf_name):  # ERNIE 4.5 MoE's
            writer.add_tensor(f"blk.{correction.group(1)}.exp_probs_b.bias", array.reshape(-1))
            continue
        if arch in PERMUTED_ARCHITECTURES and ("q_proj" in hf_name or "k_proj" in hf_name):
            heads = config["num_attention_heads"] if "q_proj" in hf_name else config["num_key_value_heads"]
            array = permute_rows(array, heads)
        if arch in GEMMA_ARCHITECTURES and hf_name.endswith("norm.weight"):
            array = array + np.float32(1.0)
        writer.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), array)
    for stacked_name, by_index in experts.items():
        stacked = np.stack([by_index[e] for e in sorted(by_index)])
        if (quant_type := stacked_types[stacked_name]) is None:
            writer.add_tensor(stacked_name, stacked)
        else:
            writer.add_tensor(stacked_name, quantize(stacked, quant_type), raw_dtype=quant_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_keys(writer: gguf.GGUFWriter, arch: str, config: dict) -> None:
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "longrope":  # as llama.cpp's converter writes Phi-3's 128k variants
        original = rope.get("original_max_position_embeddings") or config["original_max_position_embeddings"]
        factor = config["max_position_embeddings"] / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(factor) / math.log(original)))
    if config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    num_experts = config.get("num_experts") or config.get("num_local_experts") or config.get("moe_num_experts")
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config.get("num_experts_per_tok") or config["moe_k"])
        if config.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if arch == "ernie4_5-moe":
        writer.add_expert_shared_count(config["moe_num_shared_experts"])
        writer.add_leading_dense_block_count(config["moe_layer_start_index"])
        writer.add_interleave_moe_layer_step(config["moe_layer_interval"])
    if arch == "granite":
        writer.add_embedding_scale(config["embedding_multiplier"])
        writer.add_residual_scale(config["residual_multiplier"])
        writer.add_attention_scale(config["attention_multiplier"])
        writer.add_logit_scale(config["logits_scaling"])


@functools.lru_cache(maxsize=4)
def _tokenizer_values(tokenizer_gguf: Path) -> dict:
    """The tokenizer keys' values of a GGUF file, read once per process (gguf's reader takes ~5 s over SmolLM2's
    49k tokens and merges; a dozen families' files copy them)."""
    reader = gguf.GGUFReader(tokenizer_gguf)
    return {key: reader.fields[key].contents() for key in TOKENIZER_KEYS}


def _copy_tokenizer(writer: gguf.GGUFWriter, tokenizer_gguf: Path) -> None:
    values = _tokenizer_values(Path(tokenizer_gguf))
    writer.add_tokenizer_model(values["tokenizer.ggml.model"])
    writer.add_token_list(values["tokenizer.ggml.tokens"])
    writer.add_token_merges(values["tokenizer.ggml.merges"])
    writer.add_token_types(values["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(values["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(values["tokenizer.ggml.eos_token_id"])
