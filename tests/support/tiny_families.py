"""Tiny random models of every family the worker runs, built by transformers from a config here (no download) and
saved as Hugging Face folders: small enough for a test, with each family's details switched on and set where a
mistake would show (short sliding windows, soft-caps that bite, multipliers far from 1)."""

from __future__ import annotations

from pathlib import Path

import torch

SLIDING_WINDOW = 8  # tokens: the test prompts are several windows long
DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=49152,  # the SmolLM2 tokenizer's
    initializer_range=0.2,
    max_position_embeddings=512,
    pad_token_id=0,  # some families' defaults lie past this vocabulary
    bos_token_id=1,
    eos_token_id=2,
)
NUM_EXPERTS, TOP_K = 8, 2  # the mixtures of experts': each token picks 2 of 8
LONGROPE_ORIGINAL_LENGTH = 32  # tokens: a prompt past it takes the long factors


def _longrope() -> dict:
    pairs = DIMS["head_dim"] // 2
    return dict(
        rope_type="longrope",
        rope_theta=10000.0,
        short_factor=[1.0 + 0.1 * i for i in range(pairs)],
        long_factor=[2.0 + 0.5 * i for i in range(pairs)],
        original_max_position_embeddings=LONGROPE_ORIGINAL_LENGTH,
    )


def _configs() -> dict[str, tuple[type, dict]]:
    """Each family model's config class and its settings beyond DIMS."""
    import transformers as t

    sliding, full = "sliding_attention", "full_attention"
    return {
        "qwen3": (t.Qwen3Config, {}),
        "mistral": (t.MistralConfig, dict(sliding_window=SLIDING_WINDOW)),
        "gemma2": (
            t.Gemma2Config,
            dict(
                query_pre_attn_scalar=24,
                sliding_window=SLIDING_WINDOW,
                attn_logit_softcapping=2.0,
                final_logit_softcapping=3.0,
            ),
        ),
        "gemma3": (
            t.Gemma3TextConfig,
            dict(
                query_pre_attn_scalar=24,
                sliding_window=SLIDING_WINDOW,
                layer_types=[sliding, sliding, sliding, full],
                rope_parameters={
                    sliding: {"rope_type": "default", "rope_theta": 10000.0},
                    full: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                },
            ),
        ),
        "phi3": (t.Phi3Config, {}),
        "phi3-longrope": (
            t.Phi3Config,
            dict(rope_parameters=_longrope(), original_max_position_embeddings=LONGROPE_ORIGINAL_LENGTH),
        ),
        "olmo2": (t.Olmo2Config, {}),
        "smollm3": (t.SmolLM3Config, dict(no_rope_layers=[1, 1, 1, 0])),
        "granite": (
            t.GraniteConfig,
            dict(embedding_multiplier=6.0, attention_multiplier=0.15, residual_multiplier=0.4, logits_scaling=2.5),
        ),
        "ernie4_5": (t.Ernie4_5Config, dict(use_bias=True)),
        "qwen3_moe": (
            t.Qwen3MoeConfig,
            dict(num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=32, mlp_only_layers=[1]),
        ),
        "mixtral": (t.MixtralConfig, dict(num_local_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K)),
        "ernie4_5_moe": (
            t.Ernie4_5_MoeConfig,
            dict(
                moe_num_experts=NUM_EXPERTS,
                moe_k=TOP_K,
                moe_intermediate_size=32,
                moe_num_shared_experts=1,
                moe_layer_start_index=1,
            ),
        ),
    }


FAMILY_MODELS = tuple(_configs())


# What a GGUF file can say of each family llama.cpp converts (Mistral becomes its "llama"; Phi-3's longrope factors
# are tensors, its attention factor and original length keys): llama.cpp scales Gemma's q.k by head_dim ** -0.5 and takes Gemma 3's
# sliding layers five in six.
GGUF_FAMILY_MODELS = {
    "qwen3": {},
    "gemma2": dict(query_pre_attn_scalar=DIMS["head_dim"]),
    "gemma3": dict(query_pre_attn_scalar=DIMS["head_dim"], num_hidden_layers=6, layer_types=None),
    "phi3": {},
    "phi3-longrope": {},
    "olmo2": {},
    "smollm3": {},
    "granite": {},
    "ernie4_5": {},
    "qwen3_moe": dict(norm_topk_prob=True, mlp_only_layers=[]),  # llama.cpp's qwen3moe: experts in every layer,
    # their weights renormalised
    "mixtral": {},
    "ernie4_5_moe": {},
}


def save_tiny_model(name: str, folder: Path, tokenizer, dtype: torch.dtype = torch.float32, **overrides) -> None:
    """The tiny random `name` model (a FAMILY_MODELS key) saved in `folder` with `tokenizer`, its weights in `dtype`;
    `overrides`: config fields set otherwise."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(sum(map(ord, name)))
    config_class, settings = _configs()[name]
    config = config_class(**{**DIMS, **settings, **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if name in ("ernie4_5", "ernie4_5_moe"):  # transformers leaves its biases at zero: make them count
        with torch.no_grad():
            for parameter_name, parameter in model.named_parameters():
                if parameter_name.endswith("bias"):  # ERNIE 4.5 MoE's router correction too: it moves choices
                    parameter.normal_(0.0, 0.2 if parameter_name.endswith(".bias") else 0.05)
    model.to(dtype).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
