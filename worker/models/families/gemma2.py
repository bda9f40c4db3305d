"""Gemma 2: GeGLU with tanh GELU, (1 + w) RMS norms before and after each sublayer, embeddings scaled by
sqrt(hidden), q.k scaled by query_pre_attn_scalar ** -0.5, sliding and global layers alternating (the first
sliding), and the attention scores and final logits soft-capped."""

from __future__ import annotations

import math

from worker.models.config import config_from_gguf_common, config_from_hf_common
from worker.models.family import Family, hf_sliding_windows, refuse_if

# llama.cpp's names of the four norms of a Gemma layer (the file stores 1 + w: its converter adds the 1).
GEMMA_GGUF_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp tells the 27B models by depth: their scale differs


def gemma_details(config: dict) -> dict:
    """What Gemma 2 and 3 configs share."""
    refuse_if(bool(config.get("use_bidirectional_attention")), "use_bidirectional_attention is not supported")
    return dict(
        norm_placement="sandwich",
        activation=_activation(config),
        embedding_multiplier=math.sqrt(config["hidden_size"]),
        attention_scale=config.get("query_pre_attn_scalar", config.get("head_dim", 256)) ** -0.5,
        attention_softcap=config.get("attn_logit_softcapping"),
        final_logit_softcap=config.get("final_logit_softcapping"),
        tie_word_embeddings=config.get("tie_word_embeddings", True),
    )


def _activation(config: dict) -> str:
    activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    refuse_if(
        activation not in ("gelu_pytorch_tanh", "gelu_tanh"),
        f"Gemma activation {activation!r} is not supported (supported: gelu_pytorch_tanh)",
    )
    return "gelu_tanh"


def gemma_gguf_details(metadata: dict, arch: str) -> dict:
    num_layers = int(metadata[f"{arch}.block_count"])
    hidden_size = int(metadata[f"{arch}.embedding_length"])
    num_heads = int(metadata[f"{arch}.attention.head_count"])
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden_size // num_heads))
    scale_dim = hidden_size // num_heads if num_layers == GEMMA_27B_LAYERS[arch] else head_dim
    return dict(
        norm_placement="sandwich",
        activation="gelu_tanh",
        embedding_multiplier=math.sqrt(hidden_size),
        attention_scale=scale_dim**-0.5,
        attention_softcap=metadata.get(f"{arch}.attn_logit_softcapping"),
        final_logit_softcap=metadata.get(f"{arch}.final_logit_softcapping"),
    )


def gguf_windows(metadata: dict, arch: str, pattern: int) -> tuple:
    """llama.cpp's windows: the file's per-layer flags or pattern where it has them, else every layer but each
    `pattern`-th is a sliding one."""
    window = metadata.get(f"{arch}.attention.sliding_window")
    num_layers = int(metadata[f"{arch}.block_count"])
    if not window:
        return ()
    written = metadata.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(written, list):
        return tuple(int(window) if sliding else None for sliding in written)
    pattern = int(written or pattern)
    return tuple(int(window) if (layer + 1) % pattern else None for layer in range(num_layers))


def config_from_hf(config: dict):
    windows = hf_sliding_windows(config, lambda layer: layer % 2 == 0)
    return config_from_hf_common(config, "gemma2", sliding_windows=windows, **gemma_details(config))


def config_from_gguf(metadata: dict, tensor_names: set[str]):
    windows = gguf_windows(metadata, "gemma2", 2)
    return config_from_gguf_common(
        metadata, tensor_names, "gemma2", sliding_windows=windows, **gemma_gguf_details(metadata, "gemma2")
    )


FAMILY = Family(
    name="gemma2",
    title="Gemma 2",
    hf_model_types=("gemma2",),
    gguf_architectures=("gemma2",),
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    gguf_layer_names=GEMMA_GGUF_NORMS,
    hf_norm_offset=1.0,
    sliding_window=True,
)
