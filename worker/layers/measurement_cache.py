"""Measurements the worker makes at its first start on a kind of machine (layers/dtype_probe.py's dtype,
layers/gemm_route.py's GEMM route), kept in one JSON file in Paddle's extension folder, beside the op build, under
keys that name what decides them (CPU model, instruction sets, threads, shapes, op build)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_FILE = "blockserve_dtype_choices.json"  # its first use's name, kept so that earlier measurements still count


def default_cache_path() -> Path:
    from paddle.utils.cpp_extension import get_build_directory

    return Path(get_build_directory()) / CACHE_FILE


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def threads() -> str:
    return os.environ.get("OMP_NUM_THREADS") or str(os.cpu_count())


def machine_key(kernels, shapes: list[tuple[int, int]]) -> str:
    """What decides a measurement of `shapes` on `kernels` (custom kernels: their ops and isa)."""
    build = Path(getattr(kernels.ops, "__file__", "") or "prebuilt").parent.name
    return f"{cpu_model_name()}|{kernels.isa.name}|threads={threads()}|{shapes}|ops={build}"


def read_cache(path: Path) -> dict:
    try:
        content = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return content if isinstance(content, dict) else {}


def write_cache(path: Path, key: str, seconds: dict[str, float]) -> None:
    """Add one entry; a cache that cannot be written only costs the next start another measurement."""
    content = read_cache(path)
    content[key] = seconds
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps(content, indent=1, sort_keys=True))
        temporary.replace(path)  # atomic: workers starting together never read half a file
    except OSError as exc:
        log.info("a measurement is not cached (%s): the next start measures again", exc)
