"""Qwen3 (dense): Qwen2 without q/k/v biases, with an RMS norm on each head of q and k before the rotation."""

from __future__ import annotations

from worker.models.config import config_from_gguf_common, config_from_hf_common
from worker.models.families.qwen2 import qwen_sliding_windows
from worker.models.family import Family


def config_from_hf(config: dict):
    return config_from_hf_common(config, "qwen3", qk_norm="head", sliding_windows=qwen_sliding_windows(config))


def config_from_gguf(metadata: dict, tensor_names: set[str]):
    return config_from_gguf_common(metadata, tensor_names, "qwen3", qk_norm="head")


FAMILY = Family(
    name="qwen3",
    title="Qwen3",
    hf_model_types=("qwen3",),
    gguf_architectures=("qwen3",),
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    gguf_layer_names={"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    sliding_window=True,
)
