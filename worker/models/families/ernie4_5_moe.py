"""ERNIE 4.5 MoE: ERNIE 4.5's layers (rotary pairs (2i, 2i+1), reordered at loading), with a mixture of experts in
place of the MLP in every moe_layer_interval-th layer from moe_layer_start_index to moe_layer_end_index (the
first layers dense). Its router takes the top k of the softmax plus a per-expert correction (moe_statics'
e_score_correction_bias) but weighs the experts by the softmax alone, renormalised with the sum floored at
moe_norm_min; shared experts (one MLP of moe_num_shared_experts times the experts' width) add to every token."""

from __future__ import annotations

from worker.models.config import config_from_gguf_common, config_from_hf_common, refuse
from worker.models.family import Family, gguf_moe_details


def config_from_hf(config: dict):
    num_layers = config["num_hidden_layers"]
    num_experts = config.get("moe_num_experts", 64)
    if not isinstance(num_experts, int):  # the vision-language models' text and image experts
        raise refuse("moe_num_experts", num_experts, ["one number (text-only ERNIE 4.5 MoE)"])
    if config.get("use_bias"):  # its lm_head would have a bias too
        raise refuse("ERNIE 4.5 MoE use_bias", True, [False])
    start = config.get("moe_layer_start_index", 1)
    end = config.get("moe_layer_end_index", -1)
    end = num_layers - 1 if end == -1 else end
    interval = config.get("moe_layer_interval", 1)
    moe_layers = tuple((i + 1) % interval == 0 and start <= i <= end for i in range(num_layers))
    return config_from_hf_common(
        config,
        "ernie4_5_moe",
        tie_word_embeddings=config.get("tie_word_embeddings", True),
        num_experts=num_experts,
        num_experts_per_token=config.get("moe_k", 6),
        moe_layers=moe_layers,
        normalize_expert_weights=True,
        expert_weights_sum_min=float(config.get("moe_norm_min", 1e-12)),
    )


def config_from_gguf(metadata: dict, tensor_names: set[str]):
    return config_from_gguf_common(
        metadata,
        tensor_names,
        "ernie4_5_moe",
        expert_weights_sum_min=1e-12,
        **gguf_moe_details(metadata, tensor_names, normalize_by_default=True),
    )


FAMILY = Family(
    name="ernie4_5_moe",
    title="ERNIE 4.5 MoE",
    hf_model_types=("ernie4_5_moe",),
    gguf_architectures=("ernie4_5-moe",),
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    hf_rope_interleaved=True,
    gguf_rope_interleaved=True,
    mixture_of_experts=True,
)
