"""Open a model (GGUF file or Hugging Face folder) and read its weights as fp32 numpy arrays."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from gpu_worker.folder_checkpoint import FolderCheckpoint
from gpu_worker.gguf_checkpoint import GGUFCheckpoint

Checkpoint = GGUFCheckpoint | FolderCheckpoint


def open_checkpoint(path: str | Path) -> Checkpoint:
    """A .gguf file, or a folder with config.json and *.safetensors."""
    path = Path(path)
    if path.is_dir():
        return FolderCheckpoint(path)
    if path.suffix == ".gguf" and path.is_file():
        return GGUFCheckpoint(path)
    raise FileNotFoundError(f"model {path} is neither a .gguf file nor a model folder")


def read_weights(checkpoint: Checkpoint) -> dict[str, np.ndarray]:
    """Every tensor under its Hugging Face name, with a progress bar."""
    tensors = tqdm(checkpoint.tensors(), total=checkpoint.num_tensors, desc=f"Loading {checkpoint.name}", unit="tensor")
    return dict(tensors)
