"""What one model family is to the worker: the names its files go by, how its config reads into a ModelConfig, and
the few ways its weights are stored that loading must undo."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from worker.models.config import ModelConfig, UnsupportedModelError, refuse

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.architecture
    title: str  # as the README's table names it
    hf_model_types: tuple[str, ...]  # config.json's model_type
    gguf_architectures: tuple[str, ...]  # a GGUF file's general.architecture ((): not read from GGUF)
    config_from_hf: Callable[[dict], ModelConfig]
    config_from_gguf: Callable[[dict, set[str]], ModelConfig] | None = None
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)  # llama.cpp's per-layer names beyond Llama's
    hf_norm_offset: float = 0.0  # added to every norm weight of a folder (Gemma stores w of (1 + w) * x)
    hf_rope_interleaved: bool = False  # a folder's q/k rows rotate pairs (2i, 2i+1), not (i, i + d/2)
    gguf_rope_interleaved: bool = False  # llama.cpp's rows of this architecture rotate pairs (2i, 2i+1)
    sliding_window: bool = False  # whether its configs may give layers a sliding window (the README's table)
    mixture_of_experts: bool = False
    hf_renames: tuple[tuple[str, str], ...] = ()  # (part, replacement) of a folder's tensor names: into the names
    # the decoder reads (another family's spelling of the same layers)


def hf_sliding_windows(config: dict, sliding_layer: Callable[[int], bool] = lambda layer: True) -> tuple:
    """Each layer's window from config.json: its `layer_types` where written, else `sliding_layer` of the layer
    index for the family's pattern; () where the model has no window."""
    num_layers = config["num_hidden_layers"]
    layer_types = config.get("layer_types")
    if layer_types is None:
        layer_types = ["sliding_attention" if sliding_layer(i) else "full_attention" for i in range(num_layers)]
    for layer_type in layer_types:
        if layer_type not in LAYER_TYPES:
            raise refuse("layer type", layer_type, LAYER_TYPES)
    window = config.get("sliding_window")
    if not window or "sliding_attention" not in layer_types:
        return ()
    return tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)


def gguf_moe_details(metadata: dict, tensor_names: set[str], normalize_by_default: bool) -> dict:
    """The ModelConfig fields of a GGUF file's experts, as llama.cpp reads them: the layers with a router
    (ffn_gate_inp) are the mixture's; the chosen weights renormalised where `expert_weights_norm` says so, else
    as llama.cpp's graph of the architecture does (`normalize_by_default`). Softmax routers only."""
    arch = str(metadata["general.architecture"])
    gating = int(metadata.get(f"{arch}.expert_gating_func", 1))  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE
    if gating != 1:
        raise refuse("GGUF expert gating function", gating, ["1 (softmax)"])
    scale = float(metadata.get(f"{arch}.expert_weights_scale", 1.0))
    if scale != 1.0:
        raise refuse("GGUF expert weights scale", scale, [1.0])
    num_layers = int(metadata[f"{arch}.block_count"])
    return dict(
        num_experts=int(metadata[f"{arch}.expert_count"]),
        num_experts_per_token=int(metadata[f"{arch}.expert_used_count"]),
        moe_layers=tuple(f"blk.{i}.ffn_gate_inp.weight" in tensor_names for i in range(num_layers)),
        normalize_expert_weights=bool(metadata.get(f"{arch}.expert_weights_norm", normalize_by_default)),
    )


def refuse_if(condition: bool, message: str) -> None:
    if condition:
        raise UnsupportedModelError(message)
