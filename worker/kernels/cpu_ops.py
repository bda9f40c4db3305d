"""Load blockserve's C++ custom CPU operators: JIT-built once from custom_ops/ and cached, or the
extension that custom_ops/setup.py installed (the Docker image), and the CPU features they need.

A cached build that does not load (a truncated or otherwise corrupt library) is rebuilt once from
the sources, under the same lock; only a failed build falls back to pure Paddle (one warning, where
the kernels are chosen)."""

from __future__ import annotations

import fcntl
import functools
import importlib
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "custom_ops" / "build.py"
REQUIRED_CPU_FEATURES = ("avx2", "fma", "f16c")
# The ops' `isa` attribute bits (custom_ops/cpu/isa.h): extensions allowed beyond AVX2 + FMA + F16C.
ISA_AVX512, ISA_AVX512_BF16, ISA_AVX512_VNNI = 1, 2, 4
ISA_CAPS = ("avx2", "avx512", "all")  # avx2 forces AVX2; avx512 allows AVX-512F only; all = what the CPU has


@dataclass(frozen=True)
class IsaSet:
    """The instruction-set extensions the custom ops use beyond AVX2 + FMA + F16C."""

    avx512: bool = False  # AVX-512F
    bf16: bool = False  # AVX512-BF16: bf16 weights multiplied with vdpbf16ps
    vnni: bool = False  # AVX512-VNNI: int8 weights multiplied with vpdpbusd

    @property
    def bits(self) -> int:
        return ISA_AVX512 * self.avx512 | ISA_AVX512_BF16 * self.bf16 | ISA_AVX512_VNNI * self.vnni

    @property
    def name(self) -> str:
        """avx2, avx512, avx512+bf16, avx512+vnni or avx512+bf16+vnni."""
        if not self.avx512:
            return "avx2"
        return "avx512" + "+bf16" * self.bf16 + "+vnni" * self.vnni

    @classmethod
    def of(cls, features: set[str], cap: str = "all") -> IsaSet:
        """What this CPU (its /proc/cpuinfo flags) offers, up to `cap` (one of ISA_CAPS)."""
        if cap not in ISA_CAPS:
            raise ValueError(f"isa cap {cap!r} is not one of {ISA_CAPS}")
        avx512 = cap != "avx2" and "avx512f" in features
        extended = avx512 and cap == "all"
        return cls(avx512, extended and "avx512_bf16" in features, extended and "avx512_vnni" in features)


class CustomOpsUnavailable(RuntimeError):
    """The custom operators cannot run here: no build, a failed build, or a CPU without AVX2/FMA/F16C."""


def cpu_features() -> set[str]:
    """The instruction-set flags the kernel reports for this CPU (empty where /proc/cpuinfo is missing)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build_definition(script: Path, module_name: str) -> ModuleType | None:
    """A build script of custom_ops/ in a source checkout (an editable install), as a module; None in an
    installed package (which has no custom_ops/)."""
    if not script.exists():
        return None
    spec = importlib.util.spec_from_file_location(module_name, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
