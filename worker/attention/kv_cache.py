"""The paged KV cache: per layer one K and one V tensor of [num_blocks, block_size, kv_heads, row], in the
BLOCKSERVE_KV_CACHE_DTYPE resolved (layers/precision.py): float32 or bfloat16 rows of head_dim values, float16 on a
GPU, or with the custom kernels (C++ on a CPU, CUDA on a GPU) 8-bit rows (int8, fp8_e4m3) of head_dim codes and
their scale (attention/kv_rows.py)."""

from __future__ import annotations

import math

import paddle

from worker.attention.kv_rows import KV_ROW_FORMATS
from worker.host.huge_pages import HUGE_PAGE_BYTES
from worker.models.config import ModelConfig


def block_bytes(config: ModelConfig, block_size: int, dtype: str = "float32") -> int:
    """Memory one block takes across all layers, K and V."""
    row_bytes = KV_ROW_FORMATS[dtype].row_bytes(config.head_dim)
    return 2 * config.num_layers * block_size * config.num_kv_heads * row_bytes


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
    """Zero-filled K and V tensors for every layer; block ids index their first dimension. `dtype` is the
    BLOCKSERVE_KV_CACHE_DTYPE resolved (float32, bfloat16, float16, int8 or fp8_e4m3). `in_one_buffer` (a CPU's):
    every tensor a view of one zero-filled buffer from a 2 MiB boundary, one after another, so that all of the cache
    can move into 2 MiB pages (host/huge_pages.py). Tensors of their own land wherever malloc has room: in a worker
    whose heap had holes (a long test process), only 88% of a 512-block cache lay in aligned 2 MiB runs."""

    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: str = "float32", in_one_buffer: bool = False
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        row = KV_ROW_FORMATS[dtype]
        shape = [num_blocks, block_size, config.num_kv_heads, row.row_elements(config.head_dim)]
        count = 2 * config.num_layers
        if in_one_buffer:
            elements = math.prod(shape)
            padding = HUGE_PAGE_BYTES // row.element_bytes
            self._buffer = paddle.zeros([count * elements + padding], dtype=row.paddle_dtype)
            first = -self._buffer.data_ptr() % HUGE_PAGE_BYTES // row.element_bytes
            tensors = [
                self._buffer[first + i * elements : first + (i + 1) * elements].reshape(shape) for i in range(count)
            ]
        else:
            tensors = [paddle.zeros(shape, dtype=row.paddle_dtype) for _ in range(count)]
        self.key_caches = tensors[: config.num_layers]
        self.value_caches = tensors[config.num_layers :]
        self.num_bytes = num_blocks * block_bytes(config, block_size, dtype)
