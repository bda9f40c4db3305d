"""The worker's kernels, chosen once at start-up for its device: blockserve's custom ops (C++ on a CPU:
kernels/cpu.py; CUDA on a GPU: kernels/cuda.py) or plain Paddle (kernels/reference.py), the reference and the
fallback wherever the custom ops cannot run. Every path offers the calls of kernels/protocol.py."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import paddle

from worker.kernels import cuda_ops
from worker.kernels.cpu import CustomKernels
from worker.kernels.cpu_isa import REQUIRED_CPU_FEATURES, IsaSet, cpu_features
from worker.kernels.cpu_ops import load_ops
from worker.kernels.cuda import CudaKernels
from worker.kernels.op_build import CustomOpsUnavailable
from worker.kernels.protocol import Kernels
from worker.kernels.reference import PaddleKernels

log = logging.getLogger(__name__)

KERNEL_MODES = ("auto", "custom", "paddle")  # auto = custom where it builds and the device can run it
REPORTED_CPU_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
# BLOCKSERVE_CPU_ISA -> an isa cap
CPU_ISA_CAPS = {"auto": "all", "avx2": "avx2", "avx512": "avx512", "avx512+bf16+vnni": "avx512+bf16+vnni"}


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


def select_kernels(mode: str, isa_cap: str = "all") -> KernelChoice:
    """The kernels for `mode` (see KERNEL_MODES); `custom` raises CustomOpsUnavailable where they cannot run.

    `isa_cap` (cpu_isa.ISA_CAPS) keeps the custom ops below what the CPU has: `avx2` forces their AVX2
    code, `avx512` AVX-512F without the dot-product extensions, `avx512+bf16+vnni` those without AMX (tests cover
    every path).
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
        return CudaKernels(cuda_ops.load_cuda_ops())
    if paddle.get_device() != "cpu":
        raise CustomOpsUnavailable(f"the custom ops are CPU or CUDA kernels and the device is {paddle.get_device()}")
    features = cpu_features()
    missing = [feature for feature in REQUIRED_CPU_FEATURES if feature not in features]
    if missing:
        raise CustomOpsUnavailable(f"the CPU lacks {', '.join(missing)}")
    return CustomKernels(load_ops(), IsaSet.of(features, isa_cap))
