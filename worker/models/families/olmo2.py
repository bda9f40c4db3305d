"""OLMo 2: RMS norms after each sublayer (on its output, before the residual add) instead of before, and q and k
normed over the whole projection (all heads together) before the rotation."""

from __future__ import annotations

from worker.models.config import config_from_gguf_common, config_from_hf_common
from worker.models.family import Family

NORMS = dict(norm_placement="post", qk_norm="projection")


def config_from_hf(config: dict):
    return config_from_hf_common(config, "olmo2", **NORMS)


def config_from_gguf(metadata: dict, tensor_names: set[str]):
    return config_from_gguf_common(metadata, tensor_names, "olmo2", **NORMS)


FAMILY = Family(
    name="olmo2",
    title="OLMo 2",
    hf_model_types=("olmo2",),
    gguf_architectures=("olmo2",),
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    gguf_layer_names={
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
)
