"""A Hugging Face model folder as a checkpoint: config.json, tokenizer files, *.safetensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from safetensors import safe_open

from worker.loading.tokenizer import TokenizerInfo, tokenizer_from_folder
from worker.loading.weight_layout import is_norm_weight, rows_in_half_rotation
from worker.models.config import ModelConfig
from worker.models.registry import hf_family


class FolderCheckpoint:
    """Reads a folder written by `save_pretrained`."""

    def __init__(self, path: Path):
        self.path = path
        hf_config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        self.family = hf_family(hf_config)
        self.config: ModelConfig = self.family.config_from_hf(hf_config)
        self.tokenizer: TokenizerInfo = tokenizer_from_folder(path, hf_config)
        self._files = sorted(path.glob("*.safetensors"))
        if not self._files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        self.num_tensors = 0
        for file in self._files:
            with safe_open(file, framework="paddle") as tensors:
                self.num_tensors += len(tensors.keys())

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def tensor_bytes(self) -> int:
        """Bytes of its safetensors files (the tensors and a small header each)."""
        return sum(file.stat().st_size for file in self._files)

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(Hugging Face name, fp32 array) for every tensor of every shard, in the layout the layers read."""
        # Read through Paddle: numpy has no bfloat16, the usual dtype of these files.
        for file in self._files:
            with safe_open(file, framework="paddle") as tensors:
                for name in tensors.keys():
                    array = self._as_layers_read(name, tensors.get_tensor(name).astype("float32").numpy())
                    yield self._decoder_name(name), array

    def _decoder_name(self, name: str) -> str:
        for part, replacement in self.family.hf_renames:
            name = name.replace(part, replacement)
        return name

    def _as_layers_read(self, name: str, array: np.ndarray) -> np.ndarray:
        if self.family.hf_norm_offset and is_norm_weight(name):
            return array + np.float32(self.family.hf_norm_offset)
        if self.family.hf_rope_interleaved:
            return rows_in_half_rotation(name, array, self.config)
        return array
