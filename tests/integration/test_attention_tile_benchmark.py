"""benchmarks/bench_attention_tile.py times the attention tiles the worker's kernel sets compute: each cache dtype's
tile output matches a NumPy attention over the same rows (so the figures are of real attention over the tiles'
keys), and the table names each kernel set this CPU runs, and those it does not."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.support.processes import ROOT
from worker.kernels.cpu_isa import IsaSet, cpu_features

KEYS, TILES = 37, 2  # three blocks of 16, the last part-filled

# Largest |tile output - NumPy's| per cache dtype (outputs up to ~0.28): the bf16 and 8-bit caches round each row as
# they store it; the bf16 and int8 kernels also round the query (to bf16, to int8 codes) and the int8 kernels the
# values' weights. Measured on a Zen 4, every kernel set: 7e-8, 7.6e-4, 1.6e-3, 7.2e-3; about 4x that here.
TOLERANCE = {"float32": 1e-5, "bfloat16": 4e-3, "int8": 6e-3, "fp8_e4m3": 3e-2}


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_attention_tile

    yield bench_attention_tile
    sys.modules.pop("bench_attention_tile", None)
    sys.path.remove(str(ROOT / "benchmarks"))


@pytest.fixture(scope="module")
def timer(bench, tmp_path_factory):
    return bench.TileTimer(tmp_path_factory.mktemp("tile-bench"))


def kernel_sets_on_this_cpu() -> list[str]:
    isa = IsaSet.of(cpu_features())
    runs = {"avx2": True, "avx512": isa.avx512, "avx512_bf16": isa.bf16 and isa.vnni, "amx": isa.amx}
    return [name for name, ran in runs.items() if ran]


def harness_values(count: int, state: int = 1) -> tuple[np.ndarray, int]:
    """The harness's value sequence (attention_tile_bench.cc's Values), from `state`."""
    out = np.empty(count, dtype=np.float32)
    for i in range(count):
        state = (state * 1103515245 + 12345) & 0xFFFFFFFF
        out[i] = np.float32((state >> 8) % 2000) / np.float32(1000.0) - np.float32(1.0)
    return out, state


def reference_last_tile(bench) -> np.ndarray:
    """The last tile's attention output [heads, head_dim] in float64, from the rows as the harness makes them."""
    heads, kv_heads, dim, block = bench.HEADS, bench.KV_HEADS, bench.HEAD_DIM, bench.BLOCK_SIZE
    blocks_each = -(-KEYS // block)
    num_rows = TILES * blocks_each * block * kv_heads
    rows, state = harness_values(num_rows * 2 * dim)
    rows = rows.reshape(num_rows, 2, dim).astype(np.float64)  # each row's key, then its value
    query, _ = harness_values(TILES * heads * dim, state)
    query = query.reshape(TILES, heads, dim).astype(np.float64)[-1]
    first_slot = (TILES - 1) * blocks_each * block  # the last tile's blocks follow the others'
    out = np.empty((heads, dim))
    for head in range(heads):
        kv_head = head // (heads // kv_heads)
        at = (first_slot + np.arange(KEYS)) * kv_heads + kv_head
        scores = rows[at, 0] @ query[head] / np.sqrt(dim)
        weights = np.exp(scores - scores.max())
        out[head] = weights @ rows[at, 1] / weights.sum()
    return out


@pytest.mark.parametrize("kernels", ["avx2", "avx512", "avx512_bf16", "amx"])
def test_each_cache_dtypes_tiles_attend_as_numpy_does(bench, timer, kernels):
    if kernels not in kernel_sets_on_this_cpu():
        pytest.skip(f"this CPU does not run the {kernels} kernel set")
    timed = timer.time(kernels, list(bench.CACHE_DTYPES), KEYS, TILES, reps=2)
    expected = reference_last_tile(bench)
    for dtype, (ns, out) in timed.items():
        assert ns > 0
        error = np.abs(out - expected).max()
        assert error <= TOLERANCE[dtype], f"{dtype}: {error}"


def test_the_table_names_every_kernel_set(bench, capsys):
    bench.main(["--keys", str(KEYS), "--tiles", str(TILES), "--reps", "2"])
    lines = capsys.readouterr().out.splitlines()
    runs = kernel_sets_on_this_cpu()
    for name in bench.KERNEL_SETS:
        own = [line for line in lines if line.split()[:1] == [name]]
        if name in runs:
            assert len(own) == 1 and all(f"{dtype} " in own[0] for dtype in bench.CACHE_DTYPES), own
            assert "bfloat16" in own[0] and "(1.00x)" in own[0]
        else:
            assert own == [f"{name:<12} not on this CPU"]
