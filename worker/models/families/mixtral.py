"""Mixtral: Mistral's attention (a sliding window where the config sets one), and in every layer a mixture of
experts in place of the MLP: softmax over the experts, the top k's probabilities renormalised to sum 1. Its
folders name the experts' gate, down and up w1, w2 and w3 under block_sparse_moe; llama.cpp writes Mixtral as its
llama architecture with stacked experts (models/families/llama.py reads those files)."""

from __future__ import annotations

from worker.models.config import config_from_hf_common
from worker.models.family import Family, hf_sliding_windows


def config_from_hf(config: dict):
    num_layers = config["num_hidden_layers"]
    return config_from_hf_common(
        config,
        "mixtral",
        sliding_windows=hf_sliding_windows(config),
        num_experts=config.get("num_local_experts", 8),
        num_experts_per_token=config.get("num_experts_per_tok", 2),
        moe_layers=(True,) * num_layers,
        normalize_expert_weights=True,
    )


FAMILY = Family(
    name="mixtral",
    title="Mixtral",
    hf_model_types=("mixtral",),
    gguf_architectures=(),
    config_from_hf=config_from_hf,
    sliding_window=True,
    mixture_of_experts=True,
    hf_renames=(
        (".block_sparse_moe.", ".mlp."),
        (".w1.", ".gate_proj."),
        (".w2.", ".down_proj."),
        (".w3.", ".up_proj."),
    ),
)
