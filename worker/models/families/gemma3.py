"""Gemma 3 (text): Gemma 2's layer without soft-capping, with a (1 + w) RMS norm on each head of q and k, five
sliding layers to one global, and a rope of their own for each: base 10000 on the sliding ones, the config's base
(and linear scaling) on the global ones."""

from __future__ import annotations

from worker.models.config import RopeConfig, config_from_gguf_common, config_from_hf_common, gguf_rope, rope_from_hf
from worker.models.families.gemma2 import GEMMA_GGUF_NORMS, gemma_details, gemma_gguf_details, gguf_windows
from worker.models.family import Family, hf_sliding_windows

LOCAL_ROPE_BASE = 10000.0  # llama.cpp's, and transformers' default rope_local_base_freq


def config_from_hf(config: dict):
    pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6
    windows = hf_sliding_windows(config, lambda layer: bool((layer + 1) % pattern))
    full_rope, sliding_rope = _ropes(config)
    kinds = config.get("layer_types") or ["full_attention" if w is None else "sliding_attention" for w in windows]
    layer_ropes = tuple(sliding_rope if kind == "sliding_attention" else full_rope for kind in kinds)
    return config_from_hf_common(
        config,
        "gemma3",
        rope=full_rope,
        layer_ropes=layer_ropes,
        sliding_windows=windows,
        qk_norm="head",
        **gemma_details(config),
    )


def _ropes(config: dict) -> tuple[RopeConfig, RopeConfig]:
    """(global, sliding) ropes: transformers 5's rope_parameters per layer type, or the older rope_theta,
    rope_scaling and rope_local_base_freq."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params:
        return rope_from_hf(config, params["full_attention"]), rope_from_hf(config, params["sliding_attention"])
    local = RopeConfig(theta=float(config.get("rope_local_base_freq", LOCAL_ROPE_BASE)))
    return rope_from_hf(config), local


def config_from_gguf(metadata: dict, tensor_names: set[str]):
    windows = gguf_windows(metadata, "gemma3", 6)
    full_rope = gguf_rope(metadata)
    sliding_rope = RopeConfig(theta=LOCAL_ROPE_BASE)
    layer_ropes = tuple(full_rope if window is None else sliding_rope for window in windows) if windows else ()
    return config_from_gguf_common(
        metadata,
        tensor_names,
        "gemma3",
        layer_ropes=layer_ropes,
        sliding_windows=windows,
        qk_norm="head",
        **gemma_gguf_details(metadata, "gemma3"),
    )


FAMILY = Family(
    name="gemma3",
    title="Gemma 3 (text)",
    hf_model_types=("gemma3_text",),
    gguf_architectures=("gemma3",),
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    gguf_layer_names={**GEMMA_GGUF_NORMS, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    hf_norm_offset=1.0,
    sliding_window=True,
)
