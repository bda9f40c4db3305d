"""Load the configured model into Paddle and describe it for the api (`wire.ModelInfo`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from gpu_worker.model_config import ModelConfig
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.weights import Checkpoint, open_checkpoint, read_weights
from service import wire
from service.config import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    info: wire.ModelInfo


def model_info(checkpoint: Checkpoint, settings: Settings) -> wire.ModelInfo:
    """Name, length limit, tokenizer and special tokens as the api needs them."""
    max_model_len = checkpoint.config.max_position_embeddings
    if settings.max_model_len is not None:
        max_model_len = min(max_model_len, settings.max_model_len)
    tokenizer = checkpoint.tokenizer
    return wire.ModelInfo(
        name=settings.served_model_name or checkpoint.name,
        max_model_len=max_model_len,
        vocab_size=checkpoint.config.vocab_size,
        eos_token_ids=tokenizer.eos_token_ids,
        bos_token_id=tokenizer.bos_token_id,
        tokenizer_json=tokenizer.tokenizer.to_str(),
        chat_template=tokenizer.chat_template,
        add_bos_token=tokenizer.add_bos_token,
    )


def load_model(settings: Settings) -> LoadedModel:
    """Read `settings.model_path()` (BLOCKSERVE_MODEL) into fp32 Paddle tensors; logs the time it took."""
    started = time.perf_counter()
    checkpoint = open_checkpoint(settings.model_path())
    info = model_info(checkpoint, settings)
    model = LlamaForCausalLM(checkpoint.config, read_weights(checkpoint), max_positions=info.max_model_len)
    log.info("loaded model %s (%s) in %.1f s", info.name, checkpoint.path, time.perf_counter() - started)
    return LoadedModel(model=model, config=checkpoint.config, info=info)
