"""Where the worker computes: its device (BLOCKSERVE_DEVICE) and, on a GPU, its KV cache's size from the
device memory left once the weights are loaded (the dtype is the precision's: layers/precision.py).

Pure decisions over what the caller read from Paddle and the device, so the CPU tests cover them.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.layers.precision import DTYPE_BYTES
from worker.models.config import ModelConfig

ALLOCATOR_SLACK_BYTES = 256 * 2**20  # fragmentation of Paddle's caching allocator, the CUDA graphs of cuBLAS


class PlacementError(ValueError):
    """The settings ask for a device that this Paddle or this machine cannot serve, or leave no room for a KV cache."""


def choose_device(setting: str, compiled_with_cuda: bool, gpu_count: int) -> str:
    """ "cpu" or "gpu:N" for BLOCKSERVE_DEVICE (auto, cpu, gpu, gpu:N)."""
    if setting == "cpu" or (setting == "auto" and not (compiled_with_cuda and gpu_count > 0)):
        return "cpu"
    index = int(setting.partition(":")[2] or 0)
    if not compiled_with_cuda:
        raise PlacementError(f"BLOCKSERVE_DEVICE={setting}: this Paddle is built without CUDA")
    if index >= gpu_count:
        raise PlacementError(f"BLOCKSERVE_DEVICE={setting}: {gpu_count} GPU(s) visible")
    return f"gpu:{index}"


def activation_bytes(config: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, dtype: str) -> int:
    """A generous bound on what a step allocates besides the weights and the KV cache: a forward's
    temporaries at the full token budget, and sampling's float32/float64 copies of the logits."""
    per_token = (
        4 * config.hidden_size  # hidden, residual, normed, attention projection
        + (config.num_heads + 2 * config.num_kv_heads) * config.head_dim  # q|k|v
        + 2 * config.num_heads * config.head_dim  # rotated query, attention output
        + 3 * config.intermediate_size  # gate|up, activation
    )
    forward = max_num_batched_tokens * per_token * DTYPE_BYTES[dtype]
    sampling = max_num_seqs * config.vocab_size * 32  # logits as fp32 (x3) and a cumulative sum in fp64
    return 2 * (forward + sampling) + ALLOCATOR_SLACK_BYTES


def gpu_kv_cache_bytes(free_bytes: int, total_bytes: int, utilization: float, activation_reserve: int) -> int:
    """As vLLM's gpu_memory_utilization: the worker may use `utilization` of the device's memory; what
    is in use now (weights, CUDA context, anything else on the device) and the activations' reserve
    come off it, the KV cache gets the rest (may be negative: no room)."""
    return int(utilization * total_bytes) - (total_bytes - free_bytes) - activation_reserve


@dataclass(frozen=True)
class KVCacheBudget:
    num_bytes: int
    reason: str  # for the start-up log


def kv_cache_budget(
    explicit_bytes: int | None,
    default_bytes: int,
    device: str,
    memory: tuple[int, int] | None,
    utilization: float,
    activation_reserve: int,
) -> KVCacheBudget:
    """The KV cache's bytes: BLOCKSERVE_KV_CACHE_MEMORY when set; on a GPU otherwise what
    gpu_memory_utilization leaves of the (free, total) device memory measured after loading the
    weights; on a CPU the setting's default."""
    if explicit_bytes is not None:
        return KVCacheBudget(explicit_bytes, "BLOCKSERVE_KV_CACHE_MEMORY")
    if device == "cpu" or memory is None:
        return KVCacheBudget(default_bytes, "BLOCKSERVE_KV_CACHE_MEMORY (default)")
    free_bytes, total_bytes = memory
    budget = gpu_kv_cache_bytes(free_bytes, total_bytes, utilization, activation_reserve)
    reason = (
        f"{utilization:.0%} of {total_bytes / 2**30:.1f} GiB, less {(total_bytes - free_bytes) / 2**30:.1f} GiB "
        f"in use and {activation_reserve / 2**30:.1f} GiB for activations (BLOCKSERVE_GPU_MEMORY_UTILIZATION)"
    )
    if budget <= 0:
        raise PlacementError(f"no room for a KV cache on {device}: {reason}")
    return KVCacheBudget(budget, reason)
