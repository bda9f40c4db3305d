"""Where the worker computes: device choice, dtype choice and the KV cache's size from a device's
free memory, decided from what Paddle and the device report (worker/host/placement.py, worker/layers/precision.py)."""

import pytest

from service.contract.config import load_settings
from worker.attention.kv_cache import block_bytes, num_blocks_for
from worker.host.placement import (
    ALLOCATOR_SLACK_BYTES,
    PlacementError,
    activation_bytes,
    choose_device,
    kv_cache_budget,
)
from worker.layers.precision import Precision, PrecisionUnavailable, resolve_kv_cache, resolve_precision
from worker.models.config import ModelConfig, RopeConfig

GiB = 2**30
LLAMA_8B = ModelConfig(
    architecture="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    rope=RopeConfig(theta=500000.0),
)


@pytest.mark.parametrize(
    "setting, compiled_with_cuda, gpu_count, device",
    [
        ("auto", True, 2, "gpu:0"),
        ("auto", True, 0, "cpu"),  # a CUDA build on a machine without a visible GPU
        ("auto", False, 4, "cpu"),
        ("cpu", True, 2, "cpu"),
        ("gpu", True, 1, "gpu:0"),
        ("gpu:1", True, 2, "gpu:1"),
    ],
)
def test_device_is_the_first_gpu_where_paddle_has_cuda_and_sees_one(setting, compiled_with_cuda, gpu_count, device):
    assert choose_device(setting, compiled_with_cuda, gpu_count) == device


@pytest.mark.parametrize(
    "setting, compiled_with_cuda, gpu_count, problem",
    [("gpu", False, 0, "built without CUDA"), ("gpu:2", True, 2, "2 GPU"), ("gpu:0", True, 0, "0 GPU")],
)
def test_an_explicit_gpu_that_is_not_there_refuses_to_start(setting, compiled_with_cuda, gpu_count, problem):
    with pytest.raises(PlacementError, match=problem):
        choose_device(setting, compiled_with_cuda, gpu_count)


def test_device_setting_accepts_only_auto_cpu_and_gpu_indices():
    assert load_settings(device="gpu:3").device == "gpu:3"
    for bad in ("cuda", "gpu:", "gpu:x", "tpu:0"):
        with pytest.raises(ValueError):
            load_settings(device=bad)


def test_bfloat16_is_the_default_with_the_cuda_and_the_custom_cpu_kernels_and_float32_with_pure_paddle():
    assert resolve_precision("auto", "none", "cuda").dtype == "bfloat16"
    assert resolve_precision("float16", "none", "cuda").dtype == "float16"
    assert resolve_precision("float32", "none", "cuda").dtype == "float32"
    assert resolve_precision("auto", "none", "paddle") == Precision(
        "float32", "none", "pure-Paddle kernels compute in float32"
    )
    avx2 = resolve_precision("auto", "none", "custom", bf16_dot=False)
    assert avx2.dtype == "bfloat16" and "widened to float32" in avx2.reason  # measured: faster than float32 there
    native = resolve_precision("auto", "none", "custom", bf16_dot=True)
    assert native.dtype == "bfloat16" and "AVX512-BF16" in native.reason
    assert resolve_precision("float32", "int8", "custom", bf16_dot=True) == Precision(
        "float32", "int8", "BLOCKSERVE_DTYPE=float32"
    )


def test_auto_dtype_on_the_custom_kernels_is_the_measured_one_and_an_explicit_dtype_is_kept():
    measured = ("float32", "auto: float32, the faster for this model's linear layers (...)")
    assert resolve_precision("auto", "none", "custom", bf16_dot=True, measured_dtype=measured) == Precision(
        "float32", "none", measured[1]
    )
    assert resolve_precision("bfloat16", "none", "custom", measured_dtype=measured).dtype == "bfloat16"
    problem = (
        "head_dim 20 is not a multiple of 16"  # the pure-Paddle attention computes in float32 whatever was measured
    )
    bf16 = ("bfloat16", "auto: bfloat16 ...")
    assert (
        resolve_precision("auto", "none", "custom", attention_problem=problem, measured_dtype=bf16).dtype == "float32"
    )


def test_auto_quantization_serves_a_gguf_file_as_stored_on_the_cpu_kernels_and_nothing_else_quantized():
    gguf = resolve_precision("auto", "auto", "custom", bf16_dot=True, gguf_file=True)
    assert gguf.quantization == "gguf" and "the GGUF file's blocks as stored" in gguf.reason
    assert resolve_precision("auto", "auto", "custom", bf16_dot=True, gguf_file=False).quantization == "none"
    assert resolve_precision("auto", "auto", "cuda", gguf_file=True) == Precision(
        "bfloat16", "none", "auto: bfloat16 on a GPU with the CUDA kernels"
    )
    assert resolve_precision("auto", "auto", "paddle", gguf_file=True).quantization == "none"
    # An explicit setting is kept: none dequantizes the file, int8 requantizes it.
    assert resolve_precision("float32", "none", "custom", gguf_file=True).quantization == "none"
    assert resolve_precision("float32", "int8", "custom", gguf_file=True).quantization == "int8"
    problem = "head_dim 20 is not a multiple of 16"
    assert resolve_precision("auto", "auto", "custom", attention_problem=problem, gguf_file=True).quantization == "gguf"


@pytest.mark.parametrize("kernels, dtype", [("paddle", "bfloat16"), ("paddle", "float16"), ("custom", "float16")])
def test_a_dtype_the_kernels_cannot_serve_refuses_rather_than_serves_another(kernels, dtype):
    with pytest.raises(PrecisionUnavailable, match=f"BLOCKSERVE_DTYPE={dtype}"):
        resolve_precision(dtype, "none", kernels)


@pytest.mark.parametrize("quantization", ["int8", "gguf"])
def test_a_quantization_on_a_gpu_refuses_to_start_since_only_the_cpu_kernels_pack_it(quantization):
    with pytest.raises(PrecisionUnavailable, match=f"BLOCKSERVE_QUANTIZATION={quantization} .* CPU kernels only"):
        resolve_precision("auto", quantization, "cuda")


@pytest.mark.parametrize("kernels", ["custom", "cuda"])
def test_heads_only_the_paddle_attention_takes_make_the_precision_float32_and_refuse_another_dtype(kernels):
    problem = "head_dim 100 is not a multiple of 16"  # OpenLLaMA-3B's heads

    auto = resolve_precision("auto", "none", kernels, bf16_dot=True, attention_problem=problem)
    assert auto.dtype == auto.kv_cache_dtype == "float32" and problem in auto.reason
    assert resolve_precision("float32", "none", kernels, attention_problem=problem).dtype == "float32"
    for dtype in ("bfloat16", "float16"):
        with pytest.raises(PrecisionUnavailable, match=f"BLOCKSERVE_DTYPE={dtype}: .*{problem}.* float32"):
            resolve_precision(dtype, "none", kernels, attention_problem=problem)


def test_the_paddle_attention_keeps_the_cpu_quantizations_and_a_gpu_still_refuses_them():
    problem = "head_dim 20 is not a multiple of 16"
    assert resolve_precision("auto", "int8", "custom", attention_problem=problem) == Precision(
        "float32", "int8", f"auto: the pure-Paddle attention ({problem}) computes in float32"
    )
    with pytest.raises(PrecisionUnavailable, match="BLOCKSERVE_QUANTIZATION=int8 .* CPU kernels only"):
        resolve_precision("auto", "int8", "cuda", attention_problem=problem)


@pytest.mark.parametrize("setting, expected", [("auto", "bfloat16"), ("int8", "int8"), ("fp8", "fp8_e4m3"),
                                              ("fp8_e4m3", "fp8_e4m3"), ("float32", "float32")])  # fmt: skip
def test_the_kv_cache_dtype_is_the_dtype_unless_set_and_fp8_is_e4m3(setting, expected):
    precision = resolve_kv_cache(setting, Precision("bfloat16", "none", "r"), "custom")
    assert precision.kv_cache_dtype == expected and precision.dtype == "bfloat16"
    assert (expected in precision.reason) == (setting != "auto")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("setting, expected", [("int8", "int8"), ("fp8", "fp8_e4m3"), ("fp8_e4m3", "fp8_e4m3")])
def test_the_cuda_kernels_cache_8bit_rows_under_any_dtype(dtype, setting, expected):
    precision = resolve_kv_cache(setting, Precision(dtype, "none", "r"), "cuda")
    assert precision.kv_cache_dtype == expected and precision.dtype == dtype and expected in precision.reason


@pytest.mark.parametrize(
    "kernels, problem, setting",
    [("paddle", None, "int8"), ("paddle", None, "fp8"), ("custom", "a sliding window", "int8"),
     ("cuda", "head_dim 260 is not a multiple of 8 up to 256", "fp8_e4m3"), ("custom", None, "float16"),
     ("cuda", None, "bfloat16")],
)  # fmt: skip
def test_a_kv_cache_dtype_the_attention_cannot_read_refuses_and_names_the_setting(kernels, problem, setting):
    precision = Precision("float32", "none", "r")
    with pytest.raises(PrecisionUnavailable, match=f"BLOCKSERVE_KV_CACHE_DTYPE={setting}") as refusal:
        resolve_kv_cache(setting, precision, kernels, problem)
    if problem is not None:
        assert f"the pure-Paddle attention ({problem})" in str(refusal.value)
    assert resolve_kv_cache("auto", precision, kernels, problem) == precision


def test_kv_cache_takes_what_gpu_memory_utilization_leaves_after_the_weights_and_activations():
    # An 80 GiB device: 16 GiB of bf16 weights and 1 GiB of CUDA context in use, 63 GiB free.
    reserve = activation_bytes(LLAMA_8B, max_num_batched_tokens=2048, max_num_seqs=64, dtype="bfloat16")
    budget = kv_cache_budget(None, 512 * 2**20, "gpu:0", (63 * GiB, 80 * GiB), 0.9, reserve)
    assert budget.num_bytes == int(0.9 * 80 * GiB) - 17 * GiB - reserve
    assert "BLOCKSERVE_GPU_MEMORY_UTILIZATION" in budget.reason
    blocks = num_blocks_for(LLAMA_8B, 16, budget.num_bytes, None, "bfloat16")
    assert blocks == budget.num_bytes // (2 * 32 * 16 * 8 * 128 * 2)  # 128 KiB per block of 16 tokens
    assert blocks * block_bytes(LLAMA_8B, 16, "bfloat16") <= budget.num_bytes


def test_a_lower_utilization_or_more_memory_in_use_shrinks_the_cache_by_as_much():
    reserve = GiB
    full = kv_cache_budget(None, 0, "gpu:0", (60 * GiB, 80 * GiB), 0.9, reserve).num_bytes
    busier = kv_cache_budget(None, 0, "gpu:0", (50 * GiB, 80 * GiB), 0.9, reserve).num_bytes
    leaner = kv_cache_budget(None, 0, "gpu:0", (60 * GiB, 80 * GiB), 0.8, reserve).num_bytes
    assert full - busier == 10 * GiB
    assert full - leaner == int(0.9 * 80 * GiB) - int(0.8 * 80 * GiB)


def test_an_explicit_kv_cache_memory_wins_on_a_gpu_and_the_default_stays_on_a_cpu():
    assert kv_cache_budget(20 * GiB, 512, "gpu:0", (60 * GiB, 80 * GiB), 0.9, GiB).num_bytes == 20 * GiB
    assert kv_cache_budget(None, 512 * 2**20, "cpu", None, 0.9, GiB).num_bytes == 512 * 2**20


def test_a_device_without_room_for_the_cache_refuses_to_start_and_says_why():
    with pytest.raises(PlacementError, match="no room for a KV cache on gpu:0"):
        kv_cache_budget(None, 0, "gpu:0", (5 * GiB, 80 * GiB), 0.9, GiB)  # 75 GiB in use of a 72 GiB share


def test_activation_reserve_grows_with_the_token_budget_the_batch_and_the_dtype_width():
    base = activation_bytes(LLAMA_8B, 2048, 64, "bfloat16")
    assert activation_bytes(LLAMA_8B, 4096, 64, "bfloat16") > base
    assert activation_bytes(LLAMA_8B, 2048, 256, "bfloat16") > base
    assert activation_bytes(LLAMA_8B, 2048, 64, "float32") > base
    assert ALLOCATOR_SLACK_BYTES < base < 8 * GiB  # a few GiB at most for an 8B model's step
