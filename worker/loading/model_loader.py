"""Load the configured model into Paddle and describe it for the api (`wire.ModelInfo`)."""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

from service.contract import wire
from service.contract.config import Settings
from worker.host.cpu_memory import release_freed_memory, resident_anonymous_bytes
from worker.host.huge_pages import move_into_one_buffer
from worker.kernels.protocol import Kernels
from worker.layers.precision import Precision, PrecisionUnavailable
from worker.loading.checkpoint import Checkpoint, read_weights
from worker.loading.gguf_checkpoint import GGUFCheckpoint
from worker.models.config import ModelConfig
from worker.models.decoder import CausalDecoder

log = logging.getLogger(__name__)

# A GGUF file's quantisation tag: "SmolLM2-135M-Instruct.Q4_1", "Llama-3.2-1B-Instruct-Q4_K_M", "model-f16".
QUANTISATION_SUFFIX = re.compile(r"[.-](?:I?Q\d+(?:_[A-Z0-9]+)*|BF16|F16|F32)$", re.IGNORECASE)


@dataclass(frozen=True)
class LoadedModel:
    model: CausalDecoder
    config: ModelConfig
    info: wire.ModelInfo
    weight_bytes: int  # what the model's tensors hold
    file_tensor_bytes: int  # the checkpoint's tensors as stored
    resident_growth_bytes: int | None  # resident anonymous memory gained while loading (None: not measured)


def served_names(checkpoint_name: str, settings: Settings) -> tuple[str, list[str]]:
    """The name /v1/models shows, and the other names requests may use.

    Unless BLOCKSERVE_SERVED_MODEL_NAME is set: the model's name as users type it (no
    quantisation tag, as vLLM users expect), with the file's own name accepted too.
    """
    if settings.served_model_name:
        return settings.served_model_name, []
    name = QUANTISATION_SUFFIX.sub("", checkpoint_name) or checkpoint_name
    return name, [checkpoint_name] if name != checkpoint_name else []


def served_length(config: ModelConfig, settings: Settings) -> int:
    """The longest sequence the worker serves: the model's, or BLOCKSERVE_MAX_MODEL_LEN where shorter."""
    if settings.max_model_len is None:
        return config.max_position_embeddings
    return min(config.max_position_embeddings, settings.max_model_len)


def served_config(checkpoint: Checkpoint, settings: Settings) -> ModelConfig:
    """The checkpoint's config for the sequences served: a sliding window that holds them all is none."""
    return checkpoint.config.served_up_to(served_length(checkpoint.config, settings))


def model_info(checkpoint: Checkpoint, settings: Settings) -> wire.ModelInfo:
    """Name, length limit, tokenizer and special tokens as the api needs them."""
    max_model_len = served_length(checkpoint.config, settings)
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


def load_model(
    checkpoint: Checkpoint, settings: Settings, kernels: Kernels, precision: Precision, one_buffer: bool = False
) -> LoadedModel:
    """Read the weights of `checkpoint` (BLOCKSERVE_MODEL, opened) into Paddle tensors in `precision`, with
    `one_buffer` all of them in one buffer that begins on a 2 MiB boundary (huge_pages.move_into_one_buffer: the
    worker on a CPU, for 2 MiB pages); logs the time it took and the memory the weights take."""
    started = time.perf_counter()
    resident_before = resident_anonymous_bytes()
    if precision.quantization == "gguf" and not isinstance(checkpoint, GGUFCheckpoint):
        raise PrecisionUnavailable(f"BLOCKSERVE_QUANTIZATION=gguf needs a GGUF model, not {checkpoint.path}")
    info = model_info(checkpoint, settings)
    weights = read_weights(checkpoint, keep_gguf_blocks=precision.quantization == "gguf")
    config = served_config(checkpoint, settings)
    model = CausalDecoder(config, weights, info.max_model_len, kernels, precision)
    del weights
    if one_buffer:
        move_into_one_buffer(model.weight_tensors())
    release_freed_memory()  # the fp32 (or block) copies read from the file, packed and dropped by now, and the
    # tensors' memory before they moved into one buffer
    resident_after = resident_anonymous_bytes()
    loaded = LoadedModel(
        model=model,
        config=config,
        info=info,
        weight_bytes=model.weight_bytes(),
        file_tensor_bytes=checkpoint.tensor_bytes,
        resident_growth_bytes=None if resident_before is None else resident_after - resident_before,
    )
    log.info("loaded model %s (%s) in %.1f s", info.name, checkpoint.path, time.perf_counter() - started)
    growth = (
        "not measured" if loaded.resident_growth_bytes is None else f"{loaded.resident_growth_bytes / 2**20:.1f} MiB"
    )
    log.info(
        "weights: %.1f MiB in %s/%s (%.2fx the file's %.1f MiB of tensors); resident memory grew %s while loading",
        loaded.weight_bytes / 2**20,
        precision.dtype,
        precision.quantization,
        loaded.weight_bytes / loaded.file_tensor_bytes,
        loaded.file_tensor_bytes / 2**20,
        growth,
    )
    return loaded
