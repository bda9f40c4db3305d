"""The GPU goals of issue 21, measured: `python -m tests.gpu.bench_kernels [--json PATH]`.

- Decode attention's achieved memory bandwidth (K and V read once, plus queries, outputs and
  tables) at 64 and 256 sequences of 2k tokens, bf16, against this GPU's device-to-device copy
  bandwidth (bytes read + written) measured in the same run; goal: at least 70%.
- Step-input preparation on the device for 256 running requests (the two kernels, and with the
  delta's upload); goal: at most 50 us.

Device times come from CUDA events around many launches. Needs CuPy, a GPU and nvcc.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from tests.gpu.gpu_library import NoGpu, gpu_library
from tests.gpu.kernel_checks import decode_batch
from worker.inputs.step_delta import ScheduledRequest, pack_step_delta

# (name, num_heads, num_kv_heads, head_dim): one layer's attention.
GEOMETRIES = [("Llama-3-8B", 32, 8, 128), ("Qwen2.5-7B", 28, 4, 128), ("SmolLM2-135M", 9, 3, 64)]
SEQUENCES = (64, 256)
CONTEXT = 2048
BLOCK_SIZE = 16
COPY_BYTES = 2**30
ATTENTION_GOAL = 0.70
STEP_INPUT_GOAL_S = 50e-6


def device_seconds(cupy, launch, repeats: int) -> float:
    """Mean device time of launch() over `repeats` back-to-back calls, after a warm-up."""
    for _ in range(3):
        launch()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(repeats):
        launch()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / 1e3 / repeats


def copy_bandwidth(cupy, num_bytes: int) -> float:
    """Bytes per second of a device-to-device copy, counting the bytes read and those written."""
    source, target = cupy.empty(num_bytes, dtype=cupy.uint8), cupy.empty(num_bytes, dtype=cupy.uint8)
    source.fill(1)
    stream = cupy.cuda.get_current_stream().ptr
    kind = cupy.cuda.runtime.memcpyDeviceToDevice

    def copy():
        cupy.cuda.runtime.memcpyAsync(target.data.ptr, source.data.ptr, num_bytes, kind, stream)

    return 2 * num_bytes / device_seconds(cupy, copy, 20)


def random_bf16(cupy, shape):
    """Random bf16 bit patterns made on the device (rounded to nearest even)."""
    bits = cupy.random.standard_normal(shape, dtype=cupy.float32).view(cupy.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(cupy.uint16)


def attention_bandwidth(library, name, num_heads, num_kv_heads, head_dim, num_sequences) -> dict:
    cupy, arrays = library.arrays.cupy, library.arrays
    batch = decode_batch(np.random.default_rng(0), num_sequences, CONTEXT, BLOCK_SIZE)
    cache_shape = (batch["num_blocks"], BLOCK_SIZE, num_kv_heads, head_dim)
    query_shape = (num_sequences, num_heads, head_dim)
    plan = library.plan_attention(
        query_shape, num_sequences, cache_shape, batch["block_table"].shape[1], 16, arrays.num_sms
    )
    on_device = {
        "query": random_bf16(cupy, query_shape),
        "key_cache": random_bf16(cupy, cache_shape),
        "value_cache": random_bf16(cupy, cache_shape),
        **{key: arrays.put(batch[key]) for key in ("query_start", "context_lens", "block_table")},
        "out": cupy.empty((num_sequences, num_heads * head_dim), dtype=cupy.uint16),
        "workspace": cupy.empty(max(plan["workspace_floats"], 1), dtype=cupy.float32),
    }
    seconds = device_seconds(
        cupy, lambda: library.paged_attention_on_device("bfloat16", on_device, 16, arrays.num_sms), 50
    )
    kv_bytes = 2 * num_sequences * CONTEXT * num_kv_heads * head_dim * 2
    other_bytes = sum(on_device[key].nbytes for key in ("query", "out", "query_start", "context_lens", "block_table"))
    return {
        "model": name,
        "sequences": num_sequences,
        "context": CONTEXT,
        "heads": f"{num_heads}/{num_kv_heads}x{head_dim}",
        "seconds": seconds,
        "bytes": kv_bytes + other_bytes,
        "bandwidth": (kv_bytes + other_bytes) / seconds,
        "plan": plan,
    }


def step_input_time(library, num_requests: int = 256) -> dict:
    """Running decodes of 2k tokens in scattered slots, one in 16 taking a new block."""
    cupy = library.arrays.cupy
    rng = np.random.default_rng(1)
    num_slots, stride = 512, CONTEXT // BLOCK_SIZE
    slots = rng.permutation(num_slots)[:num_requests]
    blocks = CONTEXT // BLOCK_SIZE  # after this step's token
    requests = [  # 2047 tokens cached, the step's one pending from last_sampled
        ScheduledRequest(int(slot), CONTEXT - 1, 1, blocks - (i % 16 == 0), [i] * (i % 16 == 0), [])
        for i, slot in enumerate(slots)
    ]
    started = time.perf_counter()
    delta = pack_step_delta(requests)
    pack_seconds = time.perf_counter() - started
    tables = cupy.asarray(rng.integers(0, 10**6, (num_slots, stride)))
    sampled = cupy.asarray(rng.integers(0, 50000, num_slots))
    shapes = {
        "query_start": num_requests + 1,
        "context_lens": num_requests,
        "block_table": (num_requests, delta.table_width),
    }
    outs = {name: cupy.empty(shapes.get(name, delta.num_tokens), dtype=cupy.int64) for name in
            ("input_ids", "positions", "slot_mapping", "query_start", "context_lens", "block_table")}  # fmt: skip
    packed = cupy.asarray(delta.packed)
    pinned = cupy.cuda.alloc_pinned_memory(delta.packed.nbytes)
    host = np.frombuffer(pinned, dtype=np.int64, count=delta.packed.size)
    host[:] = delta.packed
    stream = cupy.cuda.get_current_stream()

    def kernels():
        library.prepare_step_inputs_on_device(
            packed, num_requests, delta.num_tokens, tables, sampled, BLOCK_SIZE, delta.table_width, outs
        )

    def upload_and_kernels():
        packed.set(host, stream=stream)
        kernels()

    return {
        "requests": num_requests,
        "delta_bytes": delta.packed.nbytes,
        "pack_seconds_host": pack_seconds,
        "kernel_seconds": device_seconds(cupy, kernels, 200),
        "upload_and_kernel_seconds": device_seconds(cupy, upload_and_kernels, 200),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    try:
        library = gpu_library()
    except NoGpu as exc:
        print(f"no GPU benchmark possible: {exc}")
        return 2
    cupy = library.arrays.cupy
    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    copy = copy_bandwidth(cupy, COPY_BYTES)
    print(
        f"{device['name'].decode()}: {library.arrays.num_sms} SMs, copy bandwidth {copy / 1e9:.0f} GB/s (read + write)"
    )
    attention = []
    for geometry in GEOMETRIES:
        for sequences in SEQUENCES:
            attention.append(attention_bandwidth(library, *geometry, sequences))
            cupy.get_default_memory_pool().free_all_blocks()  # the caches of 256 sequences take gigabytes
    for row in attention:
        row["fraction_of_copy"] = row["bandwidth"] / copy
        goal = "meets" if row["fraction_of_copy"] >= ATTENTION_GOAL else "MISSES"
        print(
            f"decode attention {row['model']:13s} {row['heads']:9s} {row['sequences']:4d} x {row['context']} tokens: "
            f"{row['seconds'] * 1e6:8.1f} us, {row['bandwidth'] / 1e9:6.0f} GB/s = {row['fraction_of_copy']:.0%} "
            f"of copy ({goal} {ATTENTION_GOAL:.0%}); splits {row['plan']['max_splits']}"
        )
    steps = step_input_time(library)
    goal = "meets" if steps["kernel_seconds"] <= STEP_INPUT_GOAL_S else "MISSES"
    print(
        f"step inputs for {steps['requests']} requests: {steps['kernel_seconds'] * 1e6:.1f} us on the device "
        f"({goal} {STEP_INPUT_GOAL_S * 1e6:.0f} us), {steps['upload_and_kernel_seconds'] * 1e6:.1f} us with the "
        f"{steps['delta_bytes']}-byte upload, {steps['pack_seconds_host'] * 1e6:.0f} us packing on the host"
    )
    if args.json:
        result = {
            "device": device["name"].decode(),
            "copy_bandwidth": copy,
            "attention": attention,
            "step_inputs": steps,
        }
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
