"""SmolLM3: Llama with no rotary embedding on some layers (no_rope_layers: 0 there; every fourth by default),
and sliding windows where use_sliding_window turns them on."""

from __future__ import annotations

from worker.models.config import config_from_gguf_common, config_from_hf_common, gguf_rope, rope_from_hf
from worker.models.family import Family, hf_sliding_windows

NO_ROPE_INTERVAL = 4  # transformers' default no_rope_layer_interval, and llama.cpp's n_no_rope_layer_step


def config_from_hf(config: dict):
    interval = config.get("no_rope_layer_interval", NO_ROPE_INTERVAL)
    uses_rope = config.get("no_rope_layers") or [
        int((layer + 1) % interval != 0) for layer in range(config["num_hidden_layers"])
    ]
    rope = rope_from_hf(config)
    windows = hf_sliding_windows(config) if config.get("use_sliding_window") else ()
    return config_from_hf_common(
        config,
        "smollm3",
        layer_ropes=tuple(rope if use else None for use in uses_rope),
        sliding_windows=windows,
    )


def config_from_gguf(metadata: dict, tensor_names: set[str]):
    rope = gguf_rope(metadata)
    num_layers = int(metadata["smollm3.block_count"])
    layer_ropes = tuple(rope if (layer + 1) % NO_ROPE_INTERVAL else None for layer in range(num_layers))
    return config_from_gguf_common(metadata, tensor_names, "smollm3", layer_ropes=layer_ropes)


FAMILY = Family(
    name="smollm3",
    title="SmolLM3",
    hf_model_types=("smollm3",),
    gguf_architectures=("smollm3",),
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    gguf_rope_interleaved=True,
    sliding_window=True,
)
