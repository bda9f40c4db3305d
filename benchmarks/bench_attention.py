"""The attention part of a SmolLM2 step (rotary embedding, KV-cache write, paged attention; 30 layers),
custom kernels against pure Paddle, on the shapes of bench_worker.py's decode B=1, decode B=64 and
prefill 1x512, a decode of 64 sequences at 300 tokens (three key spans each) and a decode of one
sequence at 2000 tokens, with a float32 and a bfloat16 KV cache
(Paddle's attention runs the float32 one only), and with the 8-bit caches (int8, fp8_e4m3), whose steps take turns
with the bf16 cache's, step by step in one process, and are quoted as a ratio of its time.

Run: python benchmarks/bench_attention.py [--repeats N] [--cache-dtype float32|bfloat16|int8|fp8_e4m3 ...]
"""

from __future__ import annotations

import argparse
import os
import time

from worker.host.cpu_threads import set_thread_defaults  # noqa: E402

set_thread_defaults()  # the worker's OpenMP settings, as in the service

import numpy as np  # noqa: E402
import paddle  # noqa: E402

from service.contract import wire  # noqa: E402
from worker.attention.kv_rows import (  # noqa: E402
    EIGHT_BIT,
    KV_ROW_FORMATS,
    encode_rows,
    int8_cache_in_groups,
    rows_in_groups,
)
from worker.host.cpu_memory import keep_freed_memory  # noqa: E402
from worker.inputs.step_inputs import RequestState, build_step_inputs  # noqa: E402
from worker.kernels.reference import PaddleKernels  # noqa: E402
from worker.kernels.selection import select_kernels  # noqa: E402
from worker.layers.rotary import RotaryEmbedding  # noqa: E402
from worker.models.config import ModelConfig, RopeConfig  # noqa: E402

NUM_LAYERS, BLOCK_SIZE, CONTEXT_LEN = 30, 16, 128
SMOLLM2 = ModelConfig(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=NUM_LAYERS,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    rope=RopeConfig(theta=100000.0),
)
CASES = {
    "decode B=1": (1, CONTEXT_LEN, 1),
    "decode B=1 at 2000": (1, 2000, 1),
    "decode B=64": (64, CONTEXT_LEN, 1),
    "decode B=64 at 300": (64, 300, 1),
    "prefill 1x512": (1, 0, 512),
}


def step_inputs(num_requests: int, num_cached: int, num_new: int):
    blocks_each = -(-(num_cached + num_new) // BLOCK_SIZE)
    states = [
        RequestState(
            f"r{i}",
            list(range(num_cached + num_new)),
            num_cached + num_new,
            wire.SamplingParams(),
            list(range(i * blocks_each, (i + 1) * blocks_each)),
            num_cached,
        )
        for i in range(num_requests)
    ]
    return build_step_inputs([(s, num_new) for s in states], BLOCK_SIZE, num_requests * blocks_each), len(
        states
    ) * blocks_each


def random_caches(
    shape: list[int], cache_dtype: str, seed: int, in_groups: bool = False
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """A layer's K and V caches of random rows (an int8 cache in_groups: placed as the kernels keep it)."""
    rng = np.random.default_rng(seed)
    if cache_dtype in EIGHT_BIT:
        rows = [encode_rows(rng.standard_normal(shape, dtype=np.float32), cache_dtype) for _ in range(2)]
        if in_groups:
            rows = [rows_in_groups(rows[0], "key"), rows_in_groups(rows[1], "value")]
        return tuple(paddle.to_tensor(r).view(KV_ROW_FORMATS[cache_dtype].paddle_dtype) for r in rows)
    return tuple(paddle.to_tensor(rng.standard_normal(shape, dtype=np.float32)).astype(cache_dtype) for _ in range(2))


def attention_step(kernels, case, cache_dtype: str = "float32"):
    """A callable: prepare + attend_qkv over every layer."""
    cfg = SMOLLM2
    inputs, num_blocks = step_inputs(*case)
    attention = kernels.attention(cfg, BLOCK_SIZE, RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings))
    shape = [num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim]
    in_groups = cache_dtype == "int8" and int8_cache_in_groups(kernels.isa, BLOCK_SIZE, cfg.head_dim)
    caches = [random_caches(shape, cache_dtype, layer, in_groups) for layer in range(NUM_LAYERS)]
    width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    qkv = paddle.to_tensor(np.random.default_rng(0).standard_normal((len(inputs.positions), width), dtype=np.float32))

    def step():
        metadata = attention.prepare(inputs)
        for key_cache, value_cache in caches:
            attention.attend_qkv(qkv, key_cache, value_cache, metadata)

    return step


def time_attention(kernels, case, repeats: int, cache_dtype: str = "float32") -> float:
    """Median seconds of prepare + attend_qkv over every layer."""
    return alternated({cache_dtype: attention_step(kernels, case, cache_dtype)}, repeats)[cache_dtype]


def alternated(steps: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each step, the steps taking turns (after one warm-up each)."""
    for step in steps.values():
        step()
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            started = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - started)
    return {name: float(np.median(taken)) for name, taken in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cache-dtype", action="append", choices=("float32", "bfloat16", *EIGHT_BIT))
    args = parser.parse_args()
    keep_freed_memory()  # as the worker does: the step's outputs are not fresh pages each call (page faults timed)
    custom = select_kernels("custom").kernels
    print(f"attention of {NUM_LAYERS} layers, SmolLM2 shapes, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    print(f"{'case':<20}{'cache':>10}{'paddle ms':>11}{'custom ms':>11}{'ratio':>8}{'/ bf16':>8}")
    dtypes = args.cache_dtype or ("float32", "bfloat16")
    for cache_dtype in [dtype for dtype in dtypes if dtype not in EIGHT_BIT]:
        for name, case in CASES.items():
            custom_s = time_attention(custom, case, args.repeats, cache_dtype)
            if cache_dtype == "float32":
                paddle_s = time_attention(PaddleKernels(), case, args.repeats)
                paddle_ms, ratio = f"{paddle_s * 1e3:>11.1f}", f"{paddle_s / custom_s:>8.1f}"
            else:
                paddle_ms, ratio = f"{'-':>11}", f"{'-':>8}"
            print(f"{name:<20}{cache_dtype:>10}{paddle_ms}{custom_s * 1e3:>11.2f}{ratio}")
    eight_bit = [dtype for dtype in dtypes if dtype in EIGHT_BIT]
    for name, case in CASES.items() if eight_bit else ():
        steps = {dtype: attention_step(custom, case, dtype) for dtype in ("bfloat16", *eight_bit)}
        medians = alternated(steps, args.repeats)
        for dtype in eight_bit:
            ratio = medians[dtype] / medians["bfloat16"]
            print(f"{name:<20}{dtype:>10}{'-':>11}{medians[dtype] * 1e3:>11.2f}{'-':>8}{ratio:>8.2f}")


if __name__ == "__main__":
    main()
