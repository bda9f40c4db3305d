"""The worker's kernels, chosen once at start-up: blockserve's custom ops (C++ on a CPU, CUDA on a GPU:
worker/kernels/cuda.py) or plain Paddle.

Both paths offer the same calls to the model: `add_rms_norm`, `silu_and_mul` and an attention
backend (`prepare(inputs)` once per step, `attend_qkv(qkv, caches, metadata)` per layer, which
applies the rotary embedding, writes the step's keys and values and attends). The pure-Paddle
path is the reference and the fallback wherever the custom ops cannot run.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import paddle
import paddle.nn.functional as F

from worker.attention.custom_kernels import CustomPagedAttention
from worker.attention.reference import PagedAttentionBackend, RotaryPagedAttention
from worker.kernels.cpu_ops import REQUIRED_CPU_FEATURES, CustomOpsUnavailable, IsaSet, cpu_features, load_ops
from worker.layers.rotary import RotaryEmbedding
from worker.models.config import ModelConfig
from worker.sample import paddle_draw as token_draw

log = logging.getLogger(__name__)

KERNEL_MODES = ("auto", "custom", "paddle")  # auto = custom where it builds and the device can run it
REPORTED_CPU_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
# bs_decoder_stack's stages, in the order of its StageSeconds output. In a decode step of at least as many
# sequences as threads, the attention's tiles rotate and write their own tokens: "attention" holds the rope + KV write.
STACK_STAGES = ("embedding", "norms", "qkv", "rope + KV write", "attention", "o", "gate_up", "silu", "down")


class PaddleKernels:
    """Plain Paddle ops (never paddle's fused RMSNorm op: its CPU kernel is AVX-512 code, SIGILL elsewhere)."""

    name = "paddle"

    def add_rms_norm(self, x, weight, residual, eps: float):
        """(rms_norm(x + residual) * weight, x + residual); residual may be None."""
        summed = x if residual is None else x + residual
        normed = summed * paddle.rsqrt(summed.square().mean(axis=-1, keepdim=True) + eps) * weight
        return normed, summed

    def silu_and_mul(self, gate_up):
        """silu(gate) * up of the fused [tokens, 2 * intermediate] gate|up output."""
        gate, up = paddle.chunk(gate_up, 2, axis=-1)
        return F.silu(gate) * up

    def argmax_rows(self, logits):
        """int64 [rows]: each row's largest entry (greedy sampling)."""
        return paddle.argmax(logits, axis=-1).astype("int64")

    def sample_rows(self, logits, params):
        """int64 [rows]: each row's draw (temperature, min_p, top_k, top_p: worker/sample/paddle_draw.py)."""
        return token_draw.sample_rows(logits, params)

    def attention(self, config: ModelConfig, block_size: int, rotary: RotaryEmbedding) -> RotaryPagedAttention:
        backend = PagedAttentionBackend(config.num_heads, config.num_kv_heads, config.head_dim, block_size)
        return RotaryPagedAttention(backend, rotary)

    def fused_stack(self, attention, config: ModelConfig):
        """None: the model runs its layers op by op."""
        return None


class CustomKernels:
    """blockserve's custom ops (custom_ops/cpu): AVX2 + FMA, and AVX-512 with its BF16 and VNNI dot products
    where the CPU has them and they are allowed."""

    name = "custom"

    def __init__(self, ops: ModuleType, isa: IsaSet, fuse_layers: bool = True):
        self.ops = ops
        self.isa = isa
        self.fuse_layers = fuse_layers  # one bs_decoder_stack call per step instead of nine ops per layer
        self._stack: FusedDecoderStack | None = None

    def add_rms_norm(self, x, weight, residual, eps: float):
        if residual is None:
            return self.ops.bs_rms_norm(x, weight, eps, self.isa.bits), x
        return self.ops.bs_add_rms_norm(x, residual, weight, eps, self.isa.bits)

    def silu_and_mul(self, gate_up):
        return self.ops.bs_silu_and_mul(gate_up, self.isa.bits)

    def argmax_rows(self, logits):
        """Paddle's CPU argmax takes ~2 ms over a [64, 49152] batch, on one thread: greedy sampling of that batch
        took 2.66 ms with it and 0.15 ms with this op (Sampler.draw on a 2-core EPYC)."""
        return self.ops.bs_argmax_rows(logits, self.isa.bits)

    def sample_rows(self, logits, params):
        """Paddle's CPU ops for the draw take 37-41 ms over a [64, 49152] batch at temperature 1 and 215-270 ms
        with top_p (on one thread each): as long as the model's step, or six; bs_sample_rows draws as token_draw does."""
        return self.ops.bs_sample_rows(logits, paddle.to_tensor(params, dtype="float64"), self.isa.bits)

    def attention(self, config: ModelConfig, block_size: int, rotary: RotaryEmbedding) -> AttentionBackend:
        if config.head_dim % 16:  # the attention kernel works on whole AVX-512 vectors of a head
            log.warning("head_dim %d is not a multiple of 16: pure-Paddle attention", config.head_dim)
            return PaddleKernels().attention(config, block_size, rotary)
        return CustomPagedAttention(self.ops, config.num_heads, config.num_kv_heads, rotary, self.isa.bits)

    def fused_stack(self, attention, config: ModelConfig):
        """A callable running every decoder layer of a step in one op, or None where the layers run op by op
        (the attention fell back to pure Paddle, or fusing is off)."""
        if not self.fuse_layers or not isinstance(attention, CustomPagedAttention):
            return None
        stack = self._stack
        if stack is None or stack.attention is not attention or stack.config is not config:
            if stack is not None:
                stack.release()
            stack = self._stack = FusedDecoderStack(self.ops, attention, config)  # one per model: it holds the inputs
        return stack


class FusedDecoderStack:
    """`(model, kv_cache, layout) -> the final norm's output [tokens, hidden]` through bs_decoder_stack: the
    embedding lookup of the ids in the step's layout, every decoder layer and the final norm, with the same kernels
    as the single ops, in one Paddle op call per step. The op holds the model's embedding, layers' norms, weights
    and caches and final norm (bs_decoder_stack_hold) under a handle, taken again when the model holds another
    of them or the cache another tensor, and let go (bs_decoder_stack_release) then, on release(), and when the
    stack is dropped."""

    def __init__(self, ops: ModuleType, attention: CustomPagedAttention, config: ModelConfig):
        self.ops = ops
        self.attention = attention
        self.config = config
        self._held_for: list = []  # the layers and caches the op holds, by identity
        self.handle: paddle.Tensor | None = None  # what the op holds them under (None: nothing yet)
        self._release: weakref.finalize | None = None
        # Off in the service. On, each call adds the wall time of each of its stages (STACK_STAGES order, summed
        # over the layers) to stage_seconds: where a benchmark's fused step goes.
        self.time_stages = False
        self._stage_seconds = np.zeros(len(STACK_STAGES))
        # The calls' clocks not yet added: read when stage_seconds is, so that a timed step does not pay for
        # reading them (right after a step, a tensor's first .numpy() takes ~0.1 ms: its memory is cold).
        self._unread_clocks: list[paddle.Tensor] = []

    def hold(self, model, kv_cache) -> paddle.Tensor:
        """The handle under which the op holds the model's embedding, layers and final norm and the cache's
        tensors (model: models/llama.py's LlamaForCausalLM, whose embedding is a PackedEmbedding)."""
        layers, embedding = model.layers, model.embed_tokens.weight
        key_caches, value_caches = kv_cache.key_caches, kv_cache.value_caches
        held_for = [embedding.packed, model.norm, *layers, *key_caches, *value_caches]
        if len(held_for) != len(self._held_for) or any(a is not b for a, b in zip(held_for, self._held_for)):
            self.release()
            self.handle = self.ops.bs_decoder_stack_hold(
                embedding.packed,
                model.norm,
                *layer_inputs(layers),
                key_caches,
                value_caches,
                [int(linear.format) for layer in layers for linear in layer.linears],
                self.config.num_heads,
                self.config.num_kv_heads,
                self.config.intermediate_size,
                int(embedding.format),
                embedding.out_features,
            )
            self._release = weakref.finalize(self, self.ops.bs_decoder_stack_release, self.handle)
            self._release.atexit = False  # at exit the process lets go of everything
            self._held_for = held_for
        return self.handle

    def release(self) -> None:
        """Let go of the layers and caches the op holds (the next call takes them again)."""
        if self._release is not None:
            self._release()
        self._held_for, self.handle, self._release = [], None, None

    def __call__(self, model, kv_cache, layout: paddle.Tensor) -> paddle.Tensor:
        """The final norm's output for the step in `layout` (custom_attention.step_layout)."""
        hidden, stage_seconds = self.ops.bs_decoder_stack(
            self.hold(model, kv_cache),
            layout,
            self.attention.rotary.cos,
            self.attention.rotary.sin,
            self.config.rms_norm_eps,
            self.attention.query_tile,
            self.attention.isa,
            self.time_stages,
        )
        if self.time_stages:
            self._unread_clocks.append(stage_seconds)
        return hidden

    @property
    def stage_seconds(self) -> np.ndarray:
        """Seconds per stage (STACK_STAGES order) of every call made with time_stages on."""
        for clock in self._unread_clocks:
            self._stage_seconds += clock.numpy()
        self._unread_clocks.clear()
        return self._stage_seconds


def layer_inputs(layers: list) -> list:
    """The norms, packed weights and biases (None: no layer has them) of `layers`, in bs_decoder_stack_hold's
    order. A GGUF file may store a projection in other formats in some layers: the op takes each one's."""
    per_kind = [[layer.input_norm for layer in layers], [layer.post_attention_norm for layer in layers]]
    per_kind += [[layer.linears[i].packed for layer in layers] for i in range(4)]
    for i in range(4):
        biases = [layer.linears[i].bias for layer in layers]
        if any(bias is None for bias in biases) and any(bias is not None for bias in biases):
            raise ValueError("a projection has a bias in some layers only")
        per_kind.append(None if biases[0] is None else biases)
    return per_kind


Kernels = PaddleKernels | CustomKernels
AttentionBackend = RotaryPagedAttention | CustomPagedAttention


@dataclass(frozen=True)
class KernelChoice:
    kernels: Kernels
    reason: str  # why this path, for the start-up log line

    def describe(self) -> dict[str, str]:
        """What the worker reports (log, hello, the scheduler's settings_info)."""
        features = cpu_features()
        return {
            "kernels": self.kernels.name,
            "kernels_isa": self.kernels.isa.name if self.kernels.name == "custom" else self.kernels.name,
            "cpu_features": ",".join(f for f in REPORTED_CPU_FEATURES if f in features) or "none",
        }


CPU_ISA_CAPS = {"auto": "all", "avx2": "avx2", "avx512": "avx512"}  # BLOCKSERVE_CPU_ISA -> an isa cap


def select_kernels(mode: str, isa_cap: str = "all") -> KernelChoice:
    """The kernels for `mode` (see KERNEL_MODES); `custom` raises CustomOpsUnavailable where they cannot run.

    `isa_cap` (custom_ops.ISA_CAPS) keeps the custom ops below what the CPU has: `avx2` forces their AVX2
    code, `avx512` AVX-512F without the dot-product extensions (tests cover every path).
    """
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernel mode {mode!r} is not one of {KERNEL_MODES}")
    if mode == "paddle":
        return KernelChoice(PaddleKernels(), "BLOCKSERVE_KERNELS=paddle")
    try:
        kernels = _custom_kernels(isa_cap)
    except CustomOpsUnavailable as exc:
        if mode == "custom":
            raise
        log.warning("custom kernels unavailable, serving with pure Paddle: %s", exc)
        return KernelChoice(PaddleKernels(), f"custom kernels unavailable: {exc}")
    capped = f", BLOCKSERVE_CPU_ISA={isa_cap}" if isa_cap != "all" and kernels.name == "custom" else ""
    return KernelChoice(kernels, f"BLOCKSERVE_KERNELS={mode}{capped}")


def _custom_kernels(isa_cap: str) -> CustomKernels:
    if paddle.get_device().startswith("gpu"):
        from worker.kernels.cuda import CudaKernels  # it builds on this module's classes
        from worker.kernels.cuda_ops import load_cuda_ops

        return CudaKernels(load_cuda_ops())
    if paddle.get_device() != "cpu":
        raise CustomOpsUnavailable(f"the custom ops are CPU or CUDA kernels and the device is {paddle.get_device()}")
    features = cpu_features()
    missing = [feature for feature in REQUIRED_CPU_FEATURES if feature not in features]
    if missing:
        raise CustomOpsUnavailable(f"the CPU lacks {', '.join(missing)}")
    return CustomKernels(load_ops(), IsaSet.of(features, isa_cap))
