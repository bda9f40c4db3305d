"""Each weight precision against float32 on SmolLM2, with the thresholds the README states ("Precision at a glance"; in full in docs/worker.md):
the mean KL divergence of the next-token distributions over tests/data/english_text.txt, and the share of
float32's greedy tokens on the 8 reference prompts that the precision picks too (tests/support/accuracy.py).
Run on everything this CPU has (the default path) and with AVX2 forced, where the arithmetic differs
(weights are widened to fp32 there, x is neither rounded nor quantized)."""

from __future__ import annotations

import pytest

from tests.support.accuracy import Float32Reference, load_runner
from tests.support.gguf_q4_k import write_with_q4_k
from worker import startup
from worker.kernels.cpu_isa import cpu_features
from worker.layers.gemm_route import GemmRoute
from worker.layers.weight_format import WeightFormat

# precision (DTYPE:QUANTIZATION) -> (largest mean KL in nats, smallest greedy agreement). Where VNNI multiplies
# int8 and GGUF weights, x is quantized per 32 inputs too (as llama.cpp does; on AMX from 64 rows, x and the weights
# are rounded to bf16 instead); elsewhere only the weights differ.
THRESHOLDS = {
    "bfloat16:none": (0.01, 0.95),
    "float32:int8": (0.05, 0.9),
    "bfloat16:int8": (0.05, 0.9),
    "float32:gguf": (0.01, 0.9),
    "bfloat16:gguf": (0.01, 0.9),
}
CASES = [(precision, "auto") for precision in THRESHOLDS] + [
    (precision, "avx2") for precision in ("bfloat16:none", "float32:int8", "float32:gguf")
]


@pytest.fixture(scope="module")
def reference(smollm_path) -> Float32Reference:
    return Float32Reference(load_runner(smollm_path, "float32:none"))


@pytest.mark.parametrize("precision, isa_cap", CASES, ids=[f"{p}-{cap}" for p, cap in CASES])
def test_precision_stays_within_its_documented_distance_from_float32(reference, smollm_path, precision, isa_cap):
    if isa_cap == "auto" and "avx512f" not in cpu_features():
        pytest.skip("this CPU has no AVX-512: the avx2 cases cover its path")
    runner = load_runner(smollm_path, precision, cpu_isa=isa_cap)
    dtype, quantization = precision.split(":")
    assert (runner.kernels["dtype"], runner.kernels["quantization"]) == (dtype, quantization)
    max_kl, min_agreement = THRESHOLDS[precision]

    accuracy = reference.accuracy_of(runner)

    print(f"{precision} on {runner.kernels['kernels_isa']}: {accuracy}")
    assert accuracy.mean_kl_nats <= max_kl
    assert accuracy.greedy_agreement >= min_agreement
    # bf16 weights: where their GEMMs run was measured (a row count, 0: never on oneDNN); other weights: not measured
    measured_route = precision == "bfloat16:none"
    assert runner.kernels["onednn_gemm_rows"].isdigit() == measured_route, runner.kernels["onednn_gemm_rows"]


def test_bf16_weights_on_onednns_matmul_stay_within_the_bf16_distance_of_float32(reference, smollm_path, monkeypatch):
    """Every GEMM of bf16 weights (a prompt's, a decode's, the lm_head's) on oneDNN's matmul, as a CPU whose
    measurement routes them from one row would run them (custom_ops/cpu/linear_onednn.h)."""
    if "avx512_bf16" not in cpu_features():
        pytest.skip("this CPU has no AVX512-BF16: oneDNN's route is for bf16 weights multiplied there")
    monkeypatch.setattr(startup, "measured_route", lambda kernels, config: GemmRoute(1, "from 1 row (the test)"))
    runner = load_runner(smollm_path, "bfloat16:none")
    assert runner.kernels["onednn_gemm_rows"] == "1"

    accuracy = reference.accuracy_of(runner)

    print(f"bfloat16:none on oneDNN's matmul, {runner.kernels['kernels_isa']}: {accuracy}")
    max_kl, min_agreement = THRESHOLDS["bfloat16:none"]
    assert accuracy.mean_kl_nats <= max_kl
    assert accuracy.greedy_agreement >= min_agreement


def test_onednn_off_keeps_bf16_gemms_on_the_kernels_without_measuring(smollm_path, monkeypatch):
    def measured_route(kernels, config):
        raise AssertionError("BLOCKSERVE_ONEDNN=off measured where the GEMMs run")

    monkeypatch.setattr(startup, "measured_route", measured_route)
    runner = load_runner(smollm_path, "bfloat16:none", onednn="off")
    assert runner.kernels["onednn_gemm_rows"] == "0"


def test_a_q4_k_file_is_served_from_its_blocks_within_the_gguf_distance_of_float32(smollm_path, tmp_path):
    """SmolLM2 with every down projection (the matrices whose rows are whole 256-weight super-blocks) stored as
    Q4_K, as a llama.cpp Q4_K_M file stores most matrices: BLOCKSERVE_QUANTIZATION=gguf serves them as Q4_1
    blocks regrouped from the file's (no dense copy), and the model stays within gguf's documented distance
    of the same file in float32."""
    q4_k_path = tmp_path / "smollm2-q4_k.gguf"
    restored = write_with_q4_k(smollm_path, q4_k_path, lambda name: ".ffn_down." in name)
    assert len(restored) == 30
    reference = Float32Reference(load_runner(q4_k_path, "float32:none"))
    runner = load_runner(q4_k_path, "bfloat16:gguf")
    assert all(layer.down.format == WeightFormat.Q4_1 for layer in runner.model.layers)

    accuracy = reference.accuracy_of(runner)

    print(f"Q4_K file, bfloat16:gguf on {runner.kernels['kernels_isa']}: {accuracy}")
    max_kl, min_agreement = THRESHOLDS["bfloat16:gguf"]
    assert accuracy.mean_kl_nats <= max_kl
    assert accuracy.greedy_agreement >= min_agreement


# An 8-bit KV cache (bf16 weights) against float32, and against the bf16 cache: its KL from float32 at most this much
# above the bf16 cache's (issue 50's goal), and its greedy agreement at least EIGHT_BIT_KV_AGREEMENT. fp8_e4m3's
# 3 mantissa bits agreed on 95.7% of the tokens on an Intel Xeon (Emerald Rapids), on 94.9% (243 of 256) on an
# AMD EPYC (Zen 4), and on 93.0% (238) on the Zen 4 with AMX emulated (tests/integration/test_amx_emulated.py; the
# bf16 GEMMs of 8 rows or more on tiles sum in another order), with about the same KL (0.0037, 0.0043, 0.0039): the
# agreement moves by a few near-tied tokens with the order of a sum, so its floor is 92%, not bf16's 95%.
EIGHT_BIT_KV_KL_ABOVE_BF16 = 0.01
EIGHT_BIT_KV_AGREEMENT = 0.92


@pytest.fixture(scope="module")
def bf16_cache_accuracy(reference, smollm_path):
    return reference.accuracy_of(load_runner(smollm_path, "bfloat16:none"))


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_an_8bit_kv_cache_stays_within_0_01_nats_of_the_bf16_caches_distance_from_float32(
    reference, bf16_cache_accuracy, smollm_path, kv_cache_dtype
):
    runner = load_runner(smollm_path, f"bfloat16:none:{kv_cache_dtype}")
    assert runner.kv_cache.dtype == kv_cache_dtype

    accuracy = reference.accuracy_of(runner)

    print(
        f"KV cache {kv_cache_dtype} on {runner.kernels['kernels_isa']}: {accuracy} (bf16 cache: {bf16_cache_accuracy})"
    )
    assert accuracy.mean_kl_nats <= bf16_cache_accuracy.mean_kl_nats + EIGHT_BIT_KV_KL_ABOVE_BF16
    assert accuracy.greedy_agreement >= EIGHT_BIT_KV_AGREEMENT
