"""Phi-3 (and Phi-3.5, Phi-4 dense): Llama with q|k|v and gate|up stored fused, a sliding window on every layer
where the config sets one, and the longrope scaling of the 128k variants (the short factors for contexts up to
the original length, the long ones past it: transformers picks by the sequence's length, the worker by the
longest it serves, as llama.cpp does by its context)."""

from __future__ import annotations

import math

from worker.models.config import (
    GGUF_TENSOR_VALUE_KEY,
    RopeConfig,
    config_from_gguf_common,
    config_from_hf_common,
    refuse,
)
from worker.models.family import Family, hf_sliding_windows


def config_from_hf(config: dict):
    return config_from_hf_common(config, "phi3", sliding_windows=hf_sliding_windows(config))


def config_from_gguf(metadata: dict, tensor_names: set[str]):
    window = metadata.get("phi3.attention.sliding_window")
    num_layers = int(metadata["phi3.block_count"])
    windows = (int(window),) * num_layers if window else ()
    details = dict(sliding_windows=windows)
    if any(name.startswith("rope_factors") for name in tensor_names):
        details["rope"] = gguf_longrope(metadata)
    return config_from_gguf_common(metadata, tensor_names, "phi3", **details)


def gguf_longrope(metadata: dict) -> RopeConfig:
    """A 128k variant's longrope as llama.cpp's converter writes it: the factors as the tensors
    rope_factors_short.weight and rope_factors_long.weight (their values in `metadata` under
    GGUF_TENSOR_VALUE_KEY: the checkpoint reads these small tensors with the keys), the original context length and
    the attention factor as keys."""
    factors = {}
    for kind in ("short", "long"):
        key = GGUF_TENSOR_VALUE_KEY.format(name=f"rope_factors_{kind}.weight")
        if key not in metadata:
            raise refuse("GGUF longrope factors", f"rope_factors_{kind}.weight missing", ["both short and long"])
        factors[kind] = tuple(float(f) for f in metadata[key])
    original = int(metadata["phi3.rope.scaling.original_context_length"])
    context = int(metadata["phi3.context_length"])
    attention_factor = metadata.get("phi3.rope.scaling.attn_factor")
    if attention_factor is None:  # as transformers computes it
        factor = context / original
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeConfig(
        float(metadata.get("phi3.rope.freq_base", 10000.0)),
        "longrope",
        short_factor=factors["short"],
        long_factor=factors["long"],
        original_max_positions=original,
        attention_factor=float(attention_factor),
    )


FAMILY = Family(
    name="phi3",
    title="Phi-3",
    hf_model_types=("phi3",),
    gguf_architectures=("phi3",),
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    gguf_layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    sliding_window=True,
)
