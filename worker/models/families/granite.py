"""Granite (3.x dense): Llama with multipliers on the embedding's output, on q.k (in place of head_dim ** -0.5),
on each sublayer's output before the residual add, and a divisor of the logits."""

from __future__ import annotations

from worker.models.config import config_from_gguf_common, config_from_hf_common
from worker.models.family import Family


def config_from_hf(config: dict):
    return config_from_hf_common(
        config,
        "granite",
        embedding_multiplier=float(config.get("embedding_multiplier", 1.0)),
        attention_scale=float(config.get("attention_multiplier", 1.0)),
        residual_multiplier=float(config.get("residual_multiplier", 1.0)),
        logit_multiplier=1.0 / float(config.get("logits_scaling", 1.0)),
    )


def config_from_gguf(metadata: dict, tensor_names: set[str]):
    return config_from_gguf_common(
        metadata,
        tensor_names,
        "granite",
        embedding_multiplier=float(metadata.get("granite.embedding_scale", 1.0)),
        attention_scale=float(metadata.get("granite.attention.scale", 1.0)),
        residual_multiplier=float(metadata.get("granite.residual_scale", 1.0)),
        logit_multiplier=1.0 / float(metadata.get("granite.logit_scale", 1.0)),
    )


FAMILY = Family(
    name="granite",
    title="Granite",
    hf_model_types=("granite",),
    gguf_architectures=("granite",),
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    gguf_rope_interleaved=True,
)
