"""Llama (and the models that are Llama in all but name: SmolLM2, Llama 3.x, TinyLlama, ...)."""

from __future__ import annotations

from worker.models.config import config_from_gguf_common, config_from_hf_common
from worker.models.family import Family


def config_from_hf(config: dict):
    return config_from_hf_common(config, "llama")


def config_from_gguf(metadata: dict, tensor_names: set[str]):
    return config_from_gguf_common(metadata, tensor_names, "llama")


FAMILY = Family(
    name="llama",
    title="Llama",
    hf_model_types=("llama",),
    gguf_architectures=("llama",),
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    gguf_rope_interleaved=True,
)
