"""Phi-3 (and Phi-3.5, Phi-4 dense): Llama with q|k|v and gate|up stored fused, a sliding window on every layer
where the config sets one, and the longrope scaling of the 128k variants (the short factors for contexts up to
the original length, the long ones past it: transformers picks by the sequence's length, the worker by the
longest it serves, as llama.cpp does by its context)."""

from __future__ import annotations

from worker.models.config import config_from_gguf_common, config_from_hf_common, refuse
from worker.models.family import Family, hf_sliding_windows


def config_from_hf(config: dict):
    return config_from_hf_common(config, "phi3", sliding_windows=hf_sliding_windows(config))


def config_from_gguf(metadata: dict, tensor_names: set[str]):
    factors = sorted(name for name in tensor_names if name.startswith("rope_factors"))
    if factors:
        raise refuse("GGUF longrope factors", factors[0], ["a Phi-3 folder with its longrope config"])
    window = metadata.get("phi3.attention.sliding_window")
    num_layers = int(metadata["phi3.block_count"])
    windows = (int(window),) * num_layers if window else ()
    return config_from_gguf_common(metadata, tensor_names, "phi3", sliding_windows=windows)


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
