"""How blockserve's C++ Paddle custom operators are built: one extension from every cpu/*.cc.

Used by the worker's loader (worker/kernels/cpu_ops.py, a cached JIT build) and by setup.py (the
Docker image prebuilds and installs the same extension).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

EXTENSION_NAME = "blockserve_ops"
SOURCE_DIR = Path(__file__).resolve().parent / "cpu"

# Baseline x86-64 code only: AVX2/FMA and AVX-512 live in functions with target attributes
# (see cpu/cpu_isa.h) chosen at run time, so no "build for this machine" arch flag and no global -mavx*.
CXX_FLAGS = ["-O3", "-fopenmp", "-std=c++17"]
# Extra headers and libraries (e.g. oneDNN's under paddle/include/third_party/install/onednn/include
# and -L<paddle/libs> -l:libdnnl.so.3): add them here, every build path reads these lists.
EXTRA_INCLUDE_DIRS: list[str] = [str(SOURCE_DIR)]
EXTRA_LDFLAGS: list[str] = ["-fopenmp"]


def sources(source_dir: Path = SOURCE_DIR) -> list[str]:
    return sorted(str(path) for path in source_dir.glob("*.cc"))


def source_hash(source_dir: Path = SOURCE_DIR) -> str:
    """Changes whenever a source, header or flag does: names the JIT build's cache folder."""
    digest = hashlib.sha256(repr((CXX_FLAGS, EXTRA_INCLUDE_DIRS, EXTRA_LDFLAGS)).encode())
    for path in sorted(source_dir.glob("*")):
        if path.suffix in (".cc", ".h"):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]
