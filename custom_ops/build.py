"""How blockserve's C++ Paddle custom operators are built: one extension from every cpu/*.cc.

Used by the worker's loader (worker/kernels/cpu_ops.py, a cached JIT build) and by setup.py (the
Docker image prebuilds and installs the same extension).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

EXTENSION_NAME = "blockserve_ops"
SOURCE_DIR = Path(__file__).resolve().parent / "cpu"

# oneDNN's C API headers (third_party/onednn: Paddle's wheel ships the library, not them).
ONEDNN_INCLUDE_DIR = Path(__file__).resolve().parent / "third_party" / "onednn" / "include"


def paddle_onednn_library() -> Path | None:
    """The oneDNN library inside Paddle's wheel (paddle/libs/libdnnl.so.3), or None where the wheel lacks it."""
    import importlib.util

    spec = importlib.util.find_spec("paddle")
    if spec is None or spec.origin is None:
        return None
    library = Path(spec.origin).parent / "libs" / "libdnnl.so.3"
    return library if library.is_file() else None


def onednn_flags() -> tuple[list[str], list[str], list[str]]:
    """(cxx flags, include dirs, link flags) that build linear_onednn.cc against Paddle's oneDNN (BS_ONEDNN: the
    bf16 GEMMs of many rows may run on its matmul), or nothing where the wheel has no oneDNN."""
    library = paddle_onednn_library()
    if library is None or not (ONEDNN_INCLUDE_DIR / "oneapi" / "dnnl" / "dnnl.h").is_file():
        return [], [], []
    libs = str(library.parent)
    return ["-DBS_ONEDNN"], [str(ONEDNN_INCLUDE_DIR)], [f"-L{libs}", "-l:libdnnl.so.3", f"-Wl,-rpath,{libs}"]


_ONEDNN_CXX, _ONEDNN_INCLUDE, _ONEDNN_LD = onednn_flags()
# Baseline x86-64 code only: AVX2/FMA and AVX-512 live in functions with target attributes
# (see cpu/cpu_isa.h) chosen at run time, so no "build for this machine" arch flag and no global -mavx*.
# -g0 undoes the -g of Python's own compile flags: debug info took a quarter of the compile time (linear_gemm.cc, the
# largest source: 97 -> 72 s on a 2-core Zen 4) and 29 of its object's 31 MB; it never changes the code, and the
# symbols stay, so perf and backtraces still name the functions.
CXX_FLAGS = ["-O3", "-g0", "-fopenmp", "-std=c++17", *_ONEDNN_CXX]
# Tests only (tests/integration/test_amx_emulated.py): with BLOCKSERVE_TEST_AMX_EMULATION=1 the AMX tile
# instructions are emulated in C++ (cpu/amx_emulation.h), so that the AMX kernel set runs, slowly, on a CPU without
# AMX. Its own flags give it its own build folder (source_hash); a served build never sets it.
AMX_EMULATION_VARIABLE = "BLOCKSERVE_TEST_AMX_EMULATION"
if os.environ.get(AMX_EMULATION_VARIABLE) == "1":
    CXX_FLAGS.append("-DBS_AMX_EMULATION")
# Extra headers and libraries: every build path reads these lists.
EXTRA_INCLUDE_DIRS: list[str] = [str(SOURCE_DIR), *_ONEDNN_INCLUDE]
EXTRA_LDFLAGS: list[str] = ["-fopenmp", *_ONEDNN_LD]


def sources(source_dir: Path = SOURCE_DIR) -> list[str]:
    return sorted(str(path) for path in source_dir.glob("*.cc"))


def source_hash(source_dir: Path = SOURCE_DIR) -> str:
    """Changes whenever a source, header or flag does: names the JIT build's cache folder."""
    digest = hashlib.sha256(repr((CXX_FLAGS, EXTRA_INCLUDE_DIRS, EXTRA_LDFLAGS)).encode())
    for path in sorted(source_dir.glob("*")):
        if path.suffix in (".cc", ".h"):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]
