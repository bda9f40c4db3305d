"""What loading the C++ and the CUDA ops shares: a build script of custom_ops/ as a module, and the error that
says the ops cannot run here."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

CUSTOM_OPS_DIR = Path(__file__).resolve().parents[2] / "custom_ops"  # in a source checkout


class CustomOpsUnavailable(RuntimeError):
    """The custom operators cannot run here: no build, a failed build, or a CPU without AVX2/FMA/F16C."""


def build_definition(script: Path, module_name: str) -> ModuleType | None:
    """A build script of custom_ops/ in a source checkout (an editable install), as a module; None in an
    installed package (which has no custom_ops/)."""
    if not script.exists():
        return None
    spec = importlib.util.spec_from_file_location(module_name, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
