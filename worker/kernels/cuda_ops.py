"""Build and load blockserve's CUDA Paddle operators: JIT-built once from custom_ops/gpu (cuda_build.py) and
cached, or the extension that custom_ops/setup.py installed on a CUDA Paddle (the GPU image)."""

from __future__ import annotations

import fcntl
import functools
import importlib
import logging
import os
from pathlib import Path
from types import ModuleType

from worker.kernels.op_build import CUSTOM_OPS_DIR, CustomOpsUnavailable, build_definition

log = logging.getLogger(__name__)

BUILD_SCRIPT = CUSTOM_OPS_DIR / "cuda_build.py"


@functools.cache
def load_cuda_ops() -> ModuleType:
    """The CUDA ops module (its functions are the PD_BUILD_OP names); raises CustomOpsUnavailable."""
    import paddle

    if not paddle.is_compiled_with_cuda():
        raise CustomOpsUnavailable("this Paddle is built without CUDA")
    build = build_definition(BUILD_SCRIPT, "blockserve_cuda_build")
    if build is None:
        try:
            return importlib.import_module("blockserve_cuda_ops")
        except ImportError as exc:
            raise CustomOpsUnavailable(f"no custom_ops sources and no prebuilt CUDA extension ({exc})") from None
    try:
        return _jit_build(build)
    except Exception as exc:
        message = " ".join(str(exc).split())
        raise CustomOpsUnavailable(f"building {build.SOURCE_DIR} failed: {type(exc).__name__}: {message}") from None


def _jit_build(build: ModuleType) -> ModuleType:
    from paddle.utils.cpp_extension import get_build_directory, load

    build_dir = Path(get_build_directory()) / f"{build.EXTENSION_NAME}_{build.source_hash()}"
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".lock", "w") as lock:  # one worker builds, the others wait and reuse it
        fcntl.flock(lock, fcntl.LOCK_EX)
        log.info("loading CUDA ops from %s (built on first use: a few minutes)", build_dir)
        return load(
            name=build.EXTENSION_NAME,
            sources=build.op_sources(),
            extra_cxx_cflags=list(build.CXX_FLAGS),
            extra_cuda_cflags=build.nvcc_flags(),
            extra_include_paths=[str(build.SOURCE_DIR)],
            build_directory=os.fspath(build_dir),
        )
