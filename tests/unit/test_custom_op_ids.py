"""The numbers Python passes to the custom ops are the ones their headers declare: the weight format ids
(custom_ops/cpu/weight_format.h), the `isa` attribute's bits (custom_ops/cpu/isa.h) and the CUDA entry points'
dtype codes (custom_ops/gpu/numeric.cuh). Python keeps its own copies (an installed worker has no headers to
read); these tests are what keeps them equal."""

from __future__ import annotations

import re
from pathlib import Path

import worker.kernels.cpu_isa as cpu_isa
from tests.gpu import kernel_library
from tests.support import kernel_reference
from worker.layers.weight_format import WeightFormat

CUSTOM_OPS = Path(__file__).resolve().parents[2] / "custom_ops"


def header_enum(path: Path, declaration: str) -> dict[str, int]:
    """The enumerators of `declaration` (e.g. "enum class Format : int") in a header, by name."""
    match = re.search(re.escape(declaration) + r"\s*\{([^}]*)\}", path.read_text())
    assert match, f"{declaration} not found in {path}"
    enumerators = re.findall(r"(\w+)\s*=\s*(\d+)", match.group(1))
    assert enumerators, f"{declaration} in {path} has no enumerators with values"
    return {name: int(value) for name, value in enumerators}


def test_weight_format_ids_are_the_headers():
    formats = header_enum(CUSTOM_OPS / "cpu" / "weight_format.h", "enum class Format : int")

    assert {name[1:].upper(): value for name, value in formats.items()} == {f.name: int(f) for f in WeightFormat}


def test_isa_bits_are_the_headers():
    bits = header_enum(CUSTOM_OPS / "cpu" / "isa.h", "enum IsaBits : int")
    # kAllowAvx512Bf16 -> ISA_AVX512_BF16
    named = {
        "ISA_" + re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name.removeprefix("kAllow")).upper(): value
        for name, value in bits.items()
    }

    assert named == {name: getattr(cpu_isa, name) for name in named}
    assert sorted(named.values()) == sorted(
        value
        for name, value in vars(cpu_isa).items()
        if re.fullmatch(r"ISA_[A-Z0-9_]+", name) and isinstance(value, int)
    )


def test_onednn_rows_shift_is_the_headers():
    (shift,) = re.findall(r"constexpr int kOneDnnRowsShift = (\d+);", (CUSTOM_OPS / "cpu" / "isa.h").read_text())
    assert int(shift) == cpu_isa.ONEDNN_ROWS_SHIFT


def test_cuda_dtype_codes_are_the_headers():
    dtypes = header_enum(CUSTOM_OPS / "gpu" / "numeric.cuh", "enum class Dtype : int")
    # kBFloat16 -> bfloat16, kFp8E4M3 -> fp8_e4m3 (BLOCKSERVE_KV_CACHE_DTYPE's name)
    codes = {name[1:].lower().replace("fp8e4m3", "fp8_e4m3"): value for name, value in dtypes.items()}
    activations = {name: value for name, value in codes.items() if name in kernel_reference.DTYPES}

    assert kernel_reference.DTYPE_CODES == activations
    assert kernel_library.DTYPE_CODES == activations
    assert kernel_library.KV_CACHE_CODES == codes  # a cache's: an activation dtype's, or an 8-bit row's
