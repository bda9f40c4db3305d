"""ERNIE 4.5 (dense): Llama whose rotary embedding rotates pairs (2i, 2i+1) of a head, with optional biases on
every projection (use_bias). Loading reorders the q and k rows of each head into Llama's (i, i + d/2) pairs, which
leaves q.k unchanged, so its layers are Llama's."""

from __future__ import annotations

from worker.models.config import config_from_gguf_common, config_from_hf_common
from worker.models.family import Family


def config_from_hf(config: dict):
    return config_from_hf_common(config, "ernie4_5", tie_word_embeddings=config.get("tie_word_embeddings", True))


def config_from_gguf(metadata: dict, tensor_names: set[str]):
    return config_from_gguf_common(metadata, tensor_names, "ernie4_5")


FAMILY = Family(
    name="ernie4_5",
    title="ERNIE 4.5",
    hf_model_types=("ernie4_5",),
    gguf_architectures=("ernie4_5",),
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    hf_rope_interleaved=True,
    gguf_rope_interleaved=True,
)
