"""The attention part of a SmolLM2 step (rotary embedding, KV-cache write, paged attention; 30 layers),
custom kernels against pure Paddle, on the shapes of bench_worker.py's decode B=64 and prefill 1x512.

Run: python benchmarks/bench_attention.py [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))

import numpy as np  # noqa: E402
import paddle  # noqa: E402

from gpu_worker.kernels import PaddleKernels, select_kernels  # noqa: E402
from gpu_worker.model_config import ModelConfig, RopeConfig  # noqa: E402
from gpu_worker.models.rope import RotaryEmbedding  # noqa: E402
from gpu_worker.step_inputs import RequestState, build_step_inputs  # noqa: E402
from service import wire  # noqa: E402

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
CASES = {"decode B=64": (64, CONTEXT_LEN, 1), "prefill 1x512": (1, 0, 512)}


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


def time_attention(kernels, case, repeats: int) -> float:
    """Median seconds of prepare + attend_qkv over every layer."""
    cfg = SMOLLM2
    inputs, num_blocks = step_inputs(*case)
    attention = kernels.attention(cfg, BLOCK_SIZE, RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings))
    shape = [num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim]
    caches = [(paddle.randn(shape), paddle.randn(shape)) for _ in range(NUM_LAYERS)]
    width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    qkv = paddle.to_tensor(np.random.default_rng(0).standard_normal((len(inputs.positions), width), dtype=np.float32))

    def step():
        metadata = attention.prepare(inputs)
        for key_cache, value_cache in caches:
            attention.attend_qkv(qkv, key_cache, value_cache, metadata)

    step()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    custom = select_kernels("custom").kernels
    print(f"attention of {NUM_LAYERS} layers, SmolLM2 shapes, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    print(f"{'case':<15}{'paddle ms':>11}{'custom ms':>11}{'ratio':>8}")
    for name, case in CASES.items():
        paddle_s = time_attention(PaddleKernels(), case, args.repeats)
        custom_s = time_attention(custom, case, args.repeats)
        print(f"{name:<15}{paddle_s * 1e3:>11.1f}{custom_s * 1e3:>11.1f}{paddle_s / custom_s:>8.1f}")


if __name__ == "__main__":
    main()
