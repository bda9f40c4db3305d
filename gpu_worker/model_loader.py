"""Load the configured model into Paddle and describe it for the api (`wire.ModelInfo`)."""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

from gpu_worker.kernels import Kernels
from gpu_worker.model_config import ModelConfig
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.weights import Checkpoint, open_checkpoint, read_weights
from service import wire
from service.config import Settings

log = logging.getLogger(__name__)

# A GGUF file's quantisation tag: "SmolLM2-135M-Instruct.Q4_1", "Llama-3.2-1B-Instruct-Q4_K_M", "model-f16".
QUANTISATION_SUFFIX = re.compile(r"[.-](?:I?Q\d+(?:_[A-Z0-9]+)*|BF16|F16|F32)$", re.IGNORECASE)


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    info: wire.ModelInfo


def served_names(checkpoint_name: str, settings: Settings) -> tuple[str, list[str]]:
    """The name /v1/models shows, and the other names requests may use.

    Unless BLOCKSERVE_SERVED_MODEL_NAME is set: the model's name as users type it (no
    quantisation tag, as vLLM users expect), with the file's own name accepted too.
    """
    if settings.served_model_name:
        return settings.served_model_name, []
    name = QUANTISATION_SUFFIX.sub("", checkpoint_name) or checkpoint_name
    return name, [checkpoint_name] if name != checkpoint_name else []


def model_info(checkpoint: Checkpoint, settings: Settings) -> wire.ModelInfo:
    """Name, length limit, tokenizer and special tokens as the api needs them."""
    max_model_len = checkpoint.config.max_position_embeddings
    if settings.max_model_len is not None:
        max_model_len = min(max_model_len, settings.max_model_len)
    tokenizer = checkpoint.tokenizer
    name, aliases = served_names(checkpoint.name, settings)
    return wire.ModelInfo(
        name=name,
        aliases=aliases,
        max_model_len=max_model_len,
        vocab_size=checkpoint.config.vocab_size,
        eos_token_ids=tokenizer.eos_token_ids,
        bos_token_id=tokenizer.bos_token_id,
        tokenizer_json=tokenizer.tokenizer.to_str(),
        chat_template=tokenizer.chat_template,
        add_bos_token=tokenizer.add_bos_token,
    )


def load_model(settings: Settings, kernels: Kernels) -> LoadedModel:
    """Read `settings.model_path()` (BLOCKSERVE_MODEL) into fp32 Paddle tensors; logs the time it took."""
    started = time.perf_counter()
    checkpoint = open_checkpoint(settings.model_path())
    info = model_info(checkpoint, settings)
    model = LlamaForCausalLM(checkpoint.config, read_weights(checkpoint), info.max_model_len, kernels)
    log.info("loaded model %s (%s) in %.1f s", info.name, checkpoint.path, time.perf_counter() - started)
    return LoadedModel(model=model, config=checkpoint.config, info=info)
