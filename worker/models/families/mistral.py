"""Mistral: Llama with a sliding window on every layer where the config sets one (7B v0.1: 4096; later ones none).
llama.cpp converts Mistral to its llama architecture, without the window."""

from __future__ import annotations

from worker.models.config import config_from_hf_common
from worker.models.family import Family, hf_sliding_windows


def config_from_hf(config: dict):
    return config_from_hf_common(config, "mistral", sliding_windows=hf_sliding_windows(config))


FAMILY = Family(
    name="mistral",
    title="Mistral",
    hf_model_types=("mistral",),
    gguf_architectures=(),
    config_from_hf=config_from_hf,
    sliding_window=True,
)
