"""Open a model (GGUF file or Hugging Face folder) and read its weights: fp32 numpy arrays, or a GGUF
file's own quantized blocks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from worker.layers.weight_format import GgufBlocks
from worker.loading.folder_checkpoint import FolderCheckpoint
from worker.loading.gguf_checkpoint import GGUFCheckpoint

Checkpoint = GGUFCheckpoint | FolderCheckpoint


def open_checkpoint(path: str | Path) -> Checkpoint:
    """A .gguf file, or a folder with config.json and *.safetensors."""
    path = Path(path)
    if path.is_dir():
        return FolderCheckpoint(path)
    if path.suffix == ".gguf" and path.is_file():
        return GGUFCheckpoint(path)
    raise FileNotFoundError(f"model {path} is neither a .gguf file nor a model folder")


def read_weights(checkpoint: Checkpoint, keep_gguf_blocks: bool = False) -> dict[str, np.ndarray | GgufBlocks]:
    """Every tensor under its Hugging Face name, with a progress bar; `keep_gguf_blocks`: a GGUF file's
    matrices in the block types the custom GEMM serves stay as stored."""
    if keep_gguf_blocks and not isinstance(checkpoint, GGUFCheckpoint):
        raise ValueError(f"{checkpoint.path} is not a GGUF file: it has no GGUF blocks to serve")
    read = checkpoint.tensors(keep_blocks=True) if keep_gguf_blocks else checkpoint.tensors()
    tensors = tqdm(read, total=checkpoint.num_tensors, desc=f"Loading {checkpoint.name}", unit="tensor")
    return dict(tensors)
