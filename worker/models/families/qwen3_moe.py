"""Qwen3-MoE: Qwen3's attention, and in the layers of the sparse step (not in mlp_only_layers) a mixture of
experts in place of the MLP: softmax over the experts, the top k's probabilities, renormalised where
norm_topk_prob. llama.cpp's qwen3moe always renormalises."""

from __future__ import annotations

from worker.models.config import config_from_gguf_common, config_from_hf_common
from worker.models.family import Family, gguf_moe_details, hf_sliding_windows


def config_from_hf(config: dict):
    num_layers = config["num_hidden_layers"]
    num_experts = config.get("num_experts", config.get("num_local_experts", 128))  # transformers 5 writes the latter
    step = config.get("decoder_sparse_step", 1)
    dense_layers = set(config.get("mlp_only_layers") or ())
    moe_layers = tuple(i not in dense_layers and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    return config_from_hf_common(
        config,
        "qwen3_moe",
        qk_norm="head",
        sliding_windows=hf_sliding_windows(config) if config.get("use_sliding_window") else (),
        num_experts=num_experts,
        num_experts_per_token=config.get("num_experts_per_tok", 8),
        moe_layers=moe_layers,
        normalize_expert_weights=bool(config.get("norm_topk_prob", False)),
    )


def config_from_gguf(metadata: dict, tensor_names: set[str]):
    return config_from_gguf_common(
        metadata,
        tensor_names,
        "qwen3_moe",
        qk_norm="head",
        **gguf_moe_details(metadata, tensor_names, normalize_by_default=True),
    )


FAMILY = Family(
    name="qwen3_moe",
    title="Qwen3-MoE",
    hf_model_types=("qwen3_moe",),
    gguf_architectures=("qwen3moe",),
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    gguf_layer_names={"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    sliding_window=True,
    mixture_of_experts=True,
)
