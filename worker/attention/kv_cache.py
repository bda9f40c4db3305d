"""The paged KV cache: per layer one K and one V tensor of [num_blocks, block_size, kv_heads, head_dim], in
the precision's dtype (layers/precision.py): float32 or bfloat16 on a CPU, also float16 on a GPU."""

from __future__ import annotations

import paddle

from worker.layers.precision import DTYPE_BYTES
from worker.models.config import ModelConfig


def block_bytes(config: ModelConfig, block_size: int, dtype: str = "float32") -> int:
    """Memory one block takes across all layers, K and V."""
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * DTYPE_BYTES[dtype]


def num_blocks_for(
    config: ModelConfig, block_size: int, kv_cache_bytes: int, num_kv_blocks: int | None, dtype: str = "float32"
) -> int:
    """`num_kv_blocks` if set, else as many blocks as `kv_cache_bytes` holds."""
    if num_kv_blocks is not None:
        return num_kv_blocks
    num_blocks = kv_cache_bytes // block_bytes(config, block_size, dtype)
    if num_blocks < 1:
        raise ValueError(
            f"BLOCKSERVE_KV_CACHE_MEMORY={kv_cache_bytes} bytes holds no block of "
            f"{block_bytes(config, block_size, dtype)} bytes"
        )
    return num_blocks


class KVCache:
    """Zero-filled K and V tensors for every layer; block ids index their first dimension."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: str = "float32"):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        shape = [num_blocks, block_size, config.num_kv_heads, config.head_dim]
        self.key_caches = [paddle.zeros(shape, dtype=dtype) for _ in range(config.num_layers)]
        self.value_caches = [paddle.zeros(shape, dtype=dtype) for _ in range(config.num_layers)]
        self.num_bytes = num_blocks * block_bytes(config, block_size, dtype)
