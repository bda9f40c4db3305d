"""The worker's parts, assembled once at start-up, each choice made before the one that depends on it: the device,
the kernels, the model's shape (read from its files), the attention for its heads, the precision for kernels and
attention together, the weights, the KV cache, and the way a step's inputs reach the model."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import paddle

from service.contract import wire
from service.contract.config import Settings
from worker.attention.backend import AttentionBackend
from worker.attention.custom_kernels import CustomPagedAttention
from worker.attention.kv_cache import KVCache, num_blocks_for
from worker.host.compute_clock import ComputeClock, gpu_event
from worker.host.cpu_memory import keep_freed_memory
from worker.host.huge_pages import BackgroundCollapse, HugePages, collapse, tensor_spans
from worker.host.model_to_device import move_model, on_host
from worker.host.placement import activation_bytes, choose_device, kv_cache_budget
from worker.inputs.device_inputs import DeviceInputs
from worker.inputs.model_inputs import HostInputs
from worker.kernels.cpu import CustomKernels
from worker.kernels.selection import CPU_ISA_CAPS, select_kernels
from worker.layers.dtype_probe import measured_dtype
from worker.layers.gemm_route import GemmRoute, measured_route, routed
from worker.layers.precision import resolve_kv_cache, resolve_precision, resolve_quantization
from worker.loading.checkpoint import open_checkpoint
from worker.loading.gguf_checkpoint import GGUFCheckpoint
from worker.loading.model_loader import load_model, served_config
from worker.models.decoder import CausalDecoder
from worker.sample.sampler import Sampler

log = logging.getLogger(__name__)

OFF_REASON = "GEMMs of bf16 weights on blockserve's kernels at every size (BLOCKSERVE_ONEDNN=off)"


@dataclass(frozen=True)
class WorkerParts:
    """What a ModelRunner computes with."""

    device: str  # cpu | gpu:N
    model: CausalDecoder
    model_info: wire.ModelInfo
    block_size: int
    num_kv_blocks: int
    kv_cache: KVCache
    attention: AttentionBackend
    step_inputs: HostInputs | DeviceInputs
    sampler: Sampler
    clock: ComputeClock
    # Reported in the hello and the scheduler's settings_info (worker_kernels, worker_device, worker_dtype, ...).
    reported: dict[str, str]
    kv_cache_move: BackgroundCollapse | None  # moving the KV cache into 2 MiB pages, or None (GPU, huge pages off)


def assemble_worker(settings: Settings) -> WorkerParts:
    """The parts for `settings`; an error names what cannot be served (worker/process.py says which setting to
    change)."""
    device = _choose_device(settings)
    choice = select_kernels(settings.kernels, CPU_ISA_CAPS[settings.cpu_isa])
    kernels = choice.kernels
    log.info("kernels: %s (%s)", " ".join(f"{k}={v}" for k, v in choice.describe().items()), choice.reason)
    checkpoint = open_checkpoint(settings.model_path())
    config = served_config(checkpoint, settings)
    # The attention before the precision: where the kernels' own cannot take the model's heads, the pure-Paddle
    # attention serves them, and it computes and caches in float32.
    attention_problem = kernels.attention_problem(config)
    if attention_problem is not None:
        log.warning("%s: pure-Paddle attention", attention_problem)
    gguf_file = isinstance(checkpoint, GGUFCheckpoint)
    measured = None
    dense = resolve_quantization(settings.quantization, kernels.name, gguf_file) == "none"
    if settings.dtype == "auto" and kernels.name == "custom" and attention_problem is None and dense:
        # The faster of bf16 and fp32 on this CPU. Quantized weights leave the dtype the KV cache and a few small
        # matrices: bfloat16 there, half the bytes a decode's attention reads.
        measurement = measured_dtype(kernels, config)
        measured = (measurement.chosen, measurement.reason)
    precision = resolve_precision(
        settings.dtype,
        settings.quantization,
        kernels.name,
        bf16_dot=kernels.name == "custom" and kernels.isa.bf16,
        attention_problem=attention_problem,
        gguf_file=gguf_file,
        measured_dtype=measured,
    )
    precision = resolve_kv_cache(settings.kv_cache_dtype, precision, kernels.name, attention_problem)
    log.info(
        "device=%s dtype=%s quantization=%s kv_cache=%s (%s)",
        device,
        precision.dtype,
        precision.quantization,
        precision.kv_cache_dtype,
        precision.reason,
    )
    gemm_route = None
    if isinstance(kernels, CustomKernels) and precision.dtype == "bfloat16" and precision.quantization == "none":
        # bf16 weights: their GEMMs of many rows on oneDNN's matmul where it measured faster on this CPU
        gemm_route = measured_route(kernels, config) if settings.onednn == "auto" else GemmRoute(0, OFF_REASON)
        log.info("%s", gemm_route.reason)
        kernels = routed(kernels, gemm_route.rows)
    with on_host():  # on a GPU the weights are read in host memory and moved once, cast to the dtype
        # On a CPU with huge pages, the weights in one buffer, so that all of them move into 2 MiB pages.
        loaded = load_model(
            checkpoint, settings, kernels, precision, one_buffer=device == "cpu" and settings.huge_pages
        )
    model = loaded.model
    if device != "cpu":
        move_model(model, device, precision.dtype)
    reported = {
        **choice.describe(),
        "device": device,
        "dtype": precision.dtype,
        "quantization": precision.quantization,
        "weights_mib": f"{model.weight_bytes() / 2**20:.1f}",  # after the move: on a GPU in the precision's dtype
        "onednn_gemm_rows": str(gemm_route.rows) if gemm_route is not None else "-",  # 0: never
    }
    block_size = settings.block_size
    budget = kv_cache_budget(
        int(settings.kv_cache_memory) if "kv_cache_memory" in settings.model_fields_set else None,
        int(settings.kv_cache_memory),
        device,
        _free_and_total_memory(device),
        settings.gpu_memory_utilization,
        activation_bytes(config, settings.max_num_batched_tokens, settings.max_num_seqs, precision.dtype),
    )
    num_kv_blocks = num_blocks_for(
        config, block_size, budget.num_bytes, settings.num_kv_blocks, precision.kv_cache_dtype
    )
    kv_cache = KVCache(config, num_kv_blocks, block_size, precision.kv_cache_dtype, in_one_buffer=device == "cpu")
    reported["huge_pages_mib"], kv_cache_move = (
        _move_to_huge_pages(settings, model, kv_cache) if device == "cpu" else ("-", None)
    )
    attention = kernels.attention(config, block_size, model.rotary)
    if kernels.name == "cuda" and isinstance(attention, CustomPagedAttention):
        max_blocks = -(-loaded.info.max_model_len // block_size)
        step_inputs = DeviceInputs(kernels.ops, block_size, settings.max_num_seqs, max_blocks)
    else:
        step_inputs = HostInputs(attention)
    log.info(
        "KV cache on %s: %d blocks of %d tokens, %s, %.1f MiB (%s)",
        device,
        num_kv_blocks,
        block_size,
        kv_cache.dtype,
        kv_cache.num_bytes / 2**20,
        budget.reason if settings.num_kv_blocks is None else "BLOCKSERVE_NUM_KV_BLOCKS",
    )
    return WorkerParts(
        device=device,
        model=model,
        model_info=loaded.info,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        kv_cache=kv_cache,
        attention=attention,
        step_inputs=step_inputs,
        sampler=Sampler(argmax=kernels.argmax_rows, sample_rows=kernels.sample_rows, mask_rows=kernels.mask_rows),
        clock=ComputeClock(gpu_event if device != "cpu" else None),
        reported=reported,
        kv_cache_move=kv_cache_move,
    )


def _choose_device(settings: Settings) -> str:
    """BLOCKSERVE_DEVICE resolved and made Paddle's device; on a CPU, freed memory kept in the heap."""
    compiled_with_cuda = paddle.is_compiled_with_cuda()
    gpu_count = paddle.device.cuda.device_count() if compiled_with_cuda else 0
    device = choose_device(settings.device, compiled_with_cuda, gpu_count)
    paddle.set_device(device)
    if device == "cpu":
        keep_freed_memory()
    return device


def _move_to_huge_pages(
    settings: Settings, model: CausalDecoder, kv_cache: KVCache
) -> tuple[str, BackgroundCollapse | None]:
    """The weights into 2 MiB pages now, and the KV cache on a thread of its own (host/huge_pages.py), unless
    BLOCKSERVE_HUGE_PAGES=0; the weights' MiB moved, as reported, and the KV cache's thread. The KV cache's move
    takes most of the time (6.5 s of a default worker's 9.9 s start for SmolLM2's 512 MiB on an Emerald Rapids VM,
    3.4 s without it), and its blocks are first written by requests that arrive as it goes, so the worker registers
    without waiting for it (`blockserve serve` ready in 5.5-6.7 s instead of 9.9 s there)."""
    if not settings.huge_pages:
        log.info("huge pages: off (BLOCKSERVE_HUGE_PAGES=0)")
        return "0.0", None
    started = time.perf_counter()
    moved = collapse(model.weight_tensors())
    _log_moved("the weights'", moved, started)
    kv_cache_move = _KvCacheMove(tensor_spans(kv_cache.key_caches + kv_cache.value_caches), "kv-cache-huge-pages")
    kv_cache_move.start()
    return f"{moved.collapsed_bytes / 2**20:.1f}", kv_cache_move


class _KvCacheMove(BackgroundCollapse):
    def run(self) -> None:
        super().run()
        _log_moved("the KV cache's", self.moved, self.started_s)


def _log_moved(what: str, moved: HugePages, started: float) -> None:
    log.info(
        "huge pages: %.1f of %s %.1f MiB in 2 MiB pages, in %.2f s%s",
        moved.collapsed_bytes / 2**20,
        what,
        moved.tensor_bytes / 2**20,
        time.perf_counter() - started,
        f"; the kernel refused the rest ({moved.refused})" if moved.refused else "",
    )


def _free_and_total_memory(device: str) -> tuple[int, int] | None:
    """(free, total) bytes of a GPU once Paddle's cache of freed blocks is returned; None on a CPU."""
    if device == "cpu":
        return None
    paddle.device.cuda.empty_cache()
    return paddle.cuda.mem_get_info(device)
