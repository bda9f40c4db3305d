"""The shape of a Llama-family decoder (Llama, Qwen2), read from GGUF metadata or config.json."""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class UnsupportedModelError(ValueError):
    """The model files describe something this worker cannot run."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings; `scaling` holds the llama3 parameters when rope_type is llama3."""

    theta: float = 10000.0
    rope_type: str = "default"
    scaling: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig


def config_from_gguf(metadata: dict[str, object], tensor_names: set[str]) -> ModelConfig:
    """Read the llama.cpp keys (`<arch>.block_count`, ...) of a GGUF file."""
    arch = str(metadata["general.architecture"])
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported ({SUPPORTED_ARCHITECTURES})")
    if "rope_freqs.weight" in tensor_names:
        raise UnsupportedModelError("GGUF rope frequency factors (rope_freqs.weight) are not supported")
    hidden_size = int(metadata[f"{arch}.embedding_length"])
    num_heads = int(metadata[f"{arch}.attention.head_count"])
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden_size // num_heads))
    vocab_size = metadata.get(f"{arch}.vocab_size") or len(metadata["tokenizer.ggml.tokens"])
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(metadata[f"{arch}.feed_forward_length"]),
        num_layers=int(metadata[f"{arch}.block_count"]),
        num_heads=num_heads,
        num_kv_heads=int(metadata.get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(metadata[f"{arch}.attention.layer_norm_rms_epsilon"]),
        max_position_embeddings=int(metadata[f"{arch}.context_length"]),
        tie_word_embeddings="output.weight" not in tensor_names,
        rope=RopeConfig(theta=float(metadata.get(f"{arch}.rope.freq_base", 10000.0))),
    )


def config_from_hf(config: dict) -> ModelConfig:
    """Read a Hugging Face config.json (old `rope_theta`/`rope_scaling` or new `rope_parameters`)."""
    arch = config.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"model_type {arch!r} is not supported ({SUPPORTED_ARCHITECTURES})")
    if config.get("use_sliding_window"):
        raise UnsupportedModelError("sliding-window attention is not supported")
    num_heads = config["num_attention_heads"]
    return ModelConfig(
        architecture=arch,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        rope=_rope_from_hf(config),
    )


def _rope_from_hf(config: dict) -> RopeConfig:
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = params.pop("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported ({SUPPORTED_ROPE_TYPES})")
    scaling = {key: float(params[key]) for key in LLAMA3_ROPE_KEYS} if rope_type == "llama3" else {}
    return RopeConfig(theta=float(theta), rope_type=rope_type, scaling=scaling)
