"""Llama (and the models that are Llama in all but name: SmolLM2, Llama 3.x, TinyLlama, ...). llama.cpp writes
Mixtral as llama too, with experts (expert_count): such a file is read as Mixtral."""

from __future__ import annotations

from worker.models.config import config_from_gguf_common, config_from_hf_common
from worker.models.family import Family, gguf_moe_details


def config_from_hf(config: dict):
    return config_from_hf_common(config, "llama")


def config_from_gguf(metadata: dict, tensor_names: set[str]):
    if int(metadata.get("llama.expert_count", 0)) > 0:
        moe = gguf_moe_details(metadata, tensor_names, normalize_by_default=True)
        return config_from_gguf_common(metadata, tensor_names, "mixtral", **moe)
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
