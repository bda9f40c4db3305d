"""Qwen2 and Qwen2.5: Llama with q/k/v biases, and sliding windows on the layers past max_window_layers where a
config turns them on."""

from __future__ import annotations

from worker.models.config import config_from_gguf_common, config_from_hf_common
from worker.models.family import Family, hf_sliding_windows


def qwen_sliding_windows(config: dict) -> tuple:
    """Qwen's windows: none unless use_sliding_window; then the layers from max_window_layers on."""
    if not config.get("use_sliding_window"):
        return ()
    first = config.get("max_window_layers", 0)
    return hf_sliding_windows(config, lambda layer: layer >= first)


def config_from_hf(config: dict):
    return config_from_hf_common(config, "qwen2", sliding_windows=qwen_sliding_windows(config))


def config_from_gguf(metadata: dict, tensor_names: set[str]):
    return config_from_gguf_common(metadata, tensor_names, "qwen2")


FAMILY = Family(
    name="qwen2",
    title="Qwen2 / Qwen2.5",
    hf_model_types=("qwen2",),
    gguf_architectures=("qwen2",),
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    sliding_window=True,
)
