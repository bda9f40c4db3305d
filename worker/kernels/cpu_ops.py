"""Build and load blockserve's C++ custom CPU operators: JIT-built once from custom_ops/cpu and cached, or the
extension that custom_ops/setup.py installed (the Docker image).

A cached build that does not load (a truncated or otherwise corrupt library) is rebuilt once from
the sources, under the same lock; only a failed build falls back to pure Paddle (one warning, where
the kernels are chosen: kernels/selection.py)."""

from __future__ import annotations

import fcntl
import functools
import importlib
import logging
import os
import shutil
from pathlib import Path
from types import ModuleType

from worker.kernels.op_build import CUSTOM_OPS_DIR, CustomOpsUnavailable, build_definition

log = logging.getLogger(__name__)

BUILD_SCRIPT = CUSTOM_OPS_DIR / "build.py"


@functools.cache
def load_ops(source_dir: Path | None = None) -> ModuleType:
    """The ops module (its functions are the PD_BUILD_OP names); raises CustomOpsUnavailable.

    `source_dir` replaces custom_ops/cpu (tests build a broken copy there).
    """
    build = build_definition(BUILD_SCRIPT, "blockserve_custom_ops_build")
    if build is None:
        try:
            return importlib.import_module("blockserve_ops")
        except ImportError as exc:
            raise CustomOpsUnavailable(f"no custom_ops sources and no prebuilt extension ({exc})") from None
    source_dir = Path(source_dir or build.SOURCE_DIR)
    try:
        return _jit_build(build, source_dir)
    except Exception as exc:
        raise CustomOpsUnavailable(f"building {source_dir} failed: {_one_line(exc)}") from None


def _one_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"  # the compiler's own errors went to stderr


def _jit_build(build: ModuleType, source_dir: Path) -> ModuleType:
    from paddle.utils.cpp_extension import get_build_directory, load

    build_dir = Path(get_build_directory()) / f"{build.EXTENSION_NAME}_{build.source_hash(source_dir)}"
    build_dir.mkdir(parents=True, exist_ok=True)
    output_dir = build_dir / build.EXTENSION_NAME  # Paddle's: the library, its version file, the objects

    def build_and_load() -> ModuleType:
        return load(
            name=build.EXTENSION_NAME,
            sources=build.sources(source_dir),
            extra_cxx_cflags=list(build.CXX_FLAGS),
            extra_ldflags=list(build.EXTRA_LDFLAGS),
            extra_include_paths=[*build.EXTRA_INCLUDE_DIRS, str(source_dir)],
            build_directory=os.fspath(build_dir),
        )

    # Workers and tests may start together: one builds, the others wait and reuse its result.
    with open(build_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        log.info("loading custom ops from %s (built on first use)", build_dir)
        if not (output_dir / f"{build.EXTENSION_NAME}.so").exists():
            return build_and_load()  # built just now: a failure is the build's, and final
        try:
            return build_and_load()
        except Exception as exc:
            # Paddle takes the library as up to date while its sources and flags are, whatever its bytes.
            log.info("the cached custom ops do not load (%s): rebuilding them from the sources", _one_line(exc))
            shutil.rmtree(output_dir)
            return build_and_load()
