"""The shape of a decoder model and the variations of its layers, as every family's files describe them (the
families read their files into it: models/families/, models/registry.py)."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
NORM_PLACEMENTS = ("pre", "sandwich", "post")  # Llama | Gemma: before and after each sublayer | OLMo2: after
ACTIVATIONS = ("silu", "gelu_tanh")


class UnsupportedModelError(ValueError):
    """The model files describe something this worker cannot run."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings: `scaling` holds llama3's four parameters, or linear's factor; longrope's
    per-pair factors for contexts up to and past `original_max_positions`, and the factor on cos and sin."""

    theta: float = 10000.0
    rope_type: str = "default"
    scaling: dict[str, float] = field(default_factory=dict)
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    original_max_positions: int = 0
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # the family's name in the registry (models/registry.py)
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
    # The variations of the families; the defaults are Llama's.
    layer_ropes: tuple[RopeConfig | None, ...] = ()  # per layer (None: no rotary embedding); empty: `rope` for all
    sliding_windows: tuple[int | None, ...] = ()  # per layer: keys within this many positions of the query
    qk_norm: str | None = None  # RMS norm of q and k before the rotation: "head" (each head) | "projection" (whole)
    norm_placement: str = "pre"  # NORM_PLACEMENTS
    activation: str = "silu"  # ACTIVATIONS, of the gate in gate|up
    embedding_multiplier: float = 1.0  # on the embedding's output (Gemma: sqrt(hidden); Granite)
    residual_multiplier: float = 1.0  # on each sublayer's output before the residual add (Granite)
    attention_scale: float | None = None  # on q.k; None: head_dim ** -0.5
    attention_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    logit_multiplier: float = 1.0  # on the logits (Granite: 1 / logits_scaling)
    # A mixture of experts: in the layers `moe_layers` marks, a router's softmax over `num_experts` picks each
    # token's `num_experts_per_token` experts, whose outputs are summed weighted by their probabilities, renormalised
    # to sum 1 where `normalize_expert_weights` (the sum floored at `expert_weights_sum_min`).
    num_experts: int = 0
    num_experts_per_token: int = 0
    moe_layers: tuple[bool, ...] = ()  # per layer: experts (True) or the dense MLP
    normalize_expert_weights: bool = False
    expert_weights_sum_min: float = 0.0

    def layer_rope(self, layer: int) -> RopeConfig | None:
        return self.layer_ropes[layer] if self.layer_ropes else self.rope

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    def sliding_window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    @property
    def has_sliding_window(self) -> bool:
        return any(window is not None for window in self.sliding_windows)

    def served_up_to(self, max_model_len: int) -> ModelConfig:
        """This config for sequences of at most `max_model_len` tokens: a window that holds them all is no window."""
        windows = tuple(None if w is None or w >= max_model_len else w for w in self.sliding_windows)
        return dataclasses.replace(self, sliding_windows=windows if any(w is not None for w in windows) else ())

    @functools.cached_property  # asked every step
    def is_llama_layer(self) -> bool:
        """Whether every layer computes what a Llama layer does (what the fused decoder stack runs)."""
        return (
            all(rope == self.rope for rope in self.layer_ropes)
            and not self.has_sliding_window
            and (self.qk_norm, self.norm_placement, self.activation) == (None, "pre", "silu")
            and (self.embedding_multiplier, self.residual_multiplier, self.logit_multiplier) == (1.0, 1.0, 1.0)
            and self.attention_scale is None
            and self.attention_softcap is None
            and self.final_logit_softcap is None
            and not any(self.moe_layers)
        )


def refuse(what: str, value: object, supported: tuple | list, note: str = "") -> UnsupportedModelError:
    """The one-line refusal naming what is not supported (and, in `note`, what it is) and listing what is."""
    listed = ", ".join(map(str, supported))
    return UnsupportedModelError(f"{what} {value!r}{note} is not supported (supported: {listed})")


def config_from_hf_common(config: dict, architecture: str, **family_details) -> ModelConfig:
    """The fields every family's config.json spells alike, with the family's details."""
    num_heads = config["num_attention_heads"]
    fields = dict(
        architecture=architecture,
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
        rope=rope_from_hf(config),
    )
    fields.update(family_details)
    return ModelConfig(**fields)


def hf_rope_parameters(config: dict) -> dict:
    """The rope parameters of config.json, new `rope_parameters` or old `rope_theta`/`rope_scaling`."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return params


def rope_from_hf(config: dict, params: dict | None = None) -> RopeConfig:
    """A RopeConfig from `params` (default: the config's own rope parameters)."""
    params = dict(hf_rope_parameters(config) if params is None else params)
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "su":  # Phi-3's early name for longrope
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise refuse("rope type", rope_type, SUPPORTED_ROPE_TYPES)
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise refuse("partial_rotary_factor", partial, [1.0])
    if rope_type == "llama3":
        return RopeConfig(theta, rope_type, {key: float(params[key]) for key in LLAMA3_ROPE_KEYS})
    if rope_type == "linear":
        return RopeConfig(theta, rope_type, {"factor": float(params["factor"])})
    if rope_type == "longrope":
        return _longrope(config, params, theta)
    return RopeConfig(theta)


def _longrope(config: dict, params: dict, theta: float) -> RopeConfig:
    """Phi-3's long-context rope, as transformers computes it: the attention factor from the ratio of the
    context lengths unless given."""
    original = int(params.get("original_max_position_embeddings") or config["original_max_position_embeddings"])
    factor = params.get("factor") or config["max_position_embeddings"] / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeConfig(
        theta,
        "longrope",
        short_factor=tuple(float(f) for f in params["short_factor"]),
        long_factor=tuple(float(f) for f in params["long_factor"]),
        original_max_positions=original,
        attention_factor=float(attention_factor),
    )


# A small tensor's values (a Phi-3 file's longrope factors) beside a GGUF file's keys, as the config reads them;
# GGUFCheckpoint puts them there (no llama.cpp key has this form).
GGUF_TENSOR_VALUE_KEY = "tensor-values:{name}"
GGUF_CONFIG_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")


def config_from_gguf_common(
    metadata: dict[str, object], tensor_names: set[str], architecture: str, **family_details
) -> ModelConfig:
    """The llama.cpp keys (`<arch>.block_count`, ...) every family's GGUF file spells alike."""
    arch = str(metadata["general.architecture"])
    hidden_size = int(metadata[f"{arch}.embedding_length"])
    num_heads = int(metadata[f"{arch}.attention.head_count"])
    vocab_size = metadata.get(f"{arch}.vocab_size") or len(metadata["tokenizer.ggml.tokens"])
    fields = dict(
        architecture=architecture,
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(metadata[f"{arch}.feed_forward_length"]),
        num_layers=int(metadata[f"{arch}.block_count"]),
        num_heads=num_heads,
        num_kv_heads=int(metadata.get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(metadata.get(f"{arch}.attention.key_length", hidden_size // num_heads)),
        rms_norm_eps=float(metadata[f"{arch}.attention.layer_norm_rms_epsilon"]),
        max_position_embeddings=int(metadata[f"{arch}.context_length"]),
        tie_word_embeddings="output.weight" not in tensor_names,
        rope=gguf_rope(metadata),
    )
    fields.update(family_details)
    return ModelConfig(**fields)


def gguf_rope(metadata: dict[str, object]) -> RopeConfig:
    """The rope of a GGUF file's keys: the base, and linear scaling where the file says so."""
    arch = str(metadata["general.architecture"])
    theta = float(metadata.get(f"{arch}.rope.freq_base", 10000.0))
    scaling_type = str(metadata.get(f"{arch}.rope.scaling.type", "none"))
    if scaling_type == "none":
        return RopeConfig(theta)
    if scaling_type == "linear":
        return RopeConfig(theta, "linear", {"factor": float(metadata[f"{arch}.rope.scaling.factor"])})
    raise refuse("GGUF rope scaling type", scaling_type, ["none", "linear"])
