"""The model families the worker runs, by the names their files give: a Hugging Face config's model_type, a GGUF
file's general.architecture. Anything else stops the worker at start-up, naming it and listing these."""

from __future__ import annotations

from worker.models.config import ModelConfig, refuse
from worker.models.families import (
    ernie4_5,
    ernie4_5_moe,
    gemma2,
    gemma3,
    granite,
    llama,
    mistral,
    mixtral,
    olmo2,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
    smollm3,
)
from worker.models.family import Family

FAMILIES: tuple[Family, ...] = tuple(
    module.FAMILY
    for module in (
        llama,
        qwen2,
        qwen3,
        mistral,
        gemma2,
        gemma3,
        phi3,
        olmo2,
        smollm3,
        granite,
        ernie4_5,
        qwen3_moe,
        mixtral,
        ernie4_5_moe,
    )
)
HF_MODEL_TYPES = {model_type: family for family in FAMILIES for model_type in family.hf_model_types}
GGUF_ARCHITECTURES = {arch: family for family in FAMILIES for arch in family.gguf_architectures}
BY_NAME = {family.name: family for family in FAMILIES}
# Where the model_type names a family's multimodal form: what to serve instead.
NOT_YET = {
    "gemma3": "Gemma 3's multimodal checkpoint (serve a text-only gemma3_text one)",
    "qwen2_moe": "a mixture of experts with a gated shared expert",
    "deepseek_v3": "a mixture of experts with grouped sigmoid routing",
}


def family_of(config: ModelConfig) -> Family:
    return BY_NAME[config.architecture]


def hf_family(hf_config: dict) -> Family:
    model_type = hf_config.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        note = f" ({NOT_YET[model_type]})" if model_type in NOT_YET else ""
        raise refuse("model_type", model_type, sorted(HF_MODEL_TYPES), note)
    return HF_MODEL_TYPES[model_type]


def gguf_family(metadata: dict) -> Family:
    arch = str(metadata.get("general.architecture"))
    if arch not in GGUF_ARCHITECTURES:
        raise refuse("GGUF architecture", arch, sorted(GGUF_ARCHITECTURES))
    return GGUF_ARCHITECTURES[arch]


def config_from_hf(hf_config: dict) -> ModelConfig:
    """A Hugging Face config.json's ModelConfig; UnsupportedModelError names what its family cannot run."""
    return hf_family(hf_config).config_from_hf(hf_config)


def config_from_gguf(metadata: dict, tensor_names: set[str]) -> ModelConfig:
    """A GGUF file's ModelConfig; UnsupportedModelError names what the worker cannot run."""
    if "rope_freqs.weight" in tensor_names:
        raise refuse("GGUF tensor", "rope_freqs.weight", ["files without rope frequency factors"])
    return gguf_family(metadata).config_from_gguf(metadata, tensor_names)
