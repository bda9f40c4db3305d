"""The arithmetic of decode attention per KV cache dtype, without the memory reads: one thread times a few decode
tiles (SmolLM2's shapes: 9 heads over 3 kv heads of head_dim 64, 16-token blocks) whose keys and values stay in
the core's L2, for each kernel set this CPU runs and each cache dtype, and sets each dtype beside the bf16
cache's (2 tiles of 129 keys hold 221 KB of bf16 rows; of 300 keys, 934 KB of float32's).

bench_worker.py and bench_attention.py time decode attention over caches far larger than the CPU's caches: their
figures mix the arithmetic with the wait for the rows, and on a shared host the memory's speed moves from minute to
minute. This one leaves only the arithmetic, so that a change to a kernel's instructions is measured in seconds and
in numbers that hold still, and the two benchmarks' figures can be split into arithmetic and reading: an 8-bit
cache reads half a bf16 cache's bytes, and its attention can be no faster than its arithmetic.

benchmarks/attention_tile_bench.cc is built (g++, a few seconds) into a library that calls the op library's kernel
sets through custom_ops/cpu/kernel_set.h; the op library is the worker's (built on first use).

Run: python benchmarks/bench_attention_tile.py [--keys N ...] [--tiles T] [--reps R]
     [--kernels avx2|avx512|avx512_bf16|amx ...] [--cache-dtype float32|bfloat16|int8|fp8_e4m3 ...]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from worker.kernels.cpu_ops import load_ops  # noqa: E402

HARNESS = Path(__file__).resolve().parent / "attention_tile_bench.cc"
KERNEL_HEADERS = REPO / "custom_ops" / "cpu"
KERNEL_SETS = ("avx2", "avx512", "avx512_bf16", "amx")
CACHE_DTYPES = ("float32", "bfloat16", "int8", "fp8_e4m3")
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16  # SmolLM2-135M
KEYS = (64, 129, 300)  # bench_worker's decode context (128) + 1, and bench_attention's 300: 1, 2 and 3 key spans


class TileTimer:
    """The harness library, built against the op library the worker loads."""

    def __init__(self, build_dir: Path):
        ops_library = Path(load_ops().__file__).parent / "blockserve_ops.so"
        ctypes.CDLL(str(ops_library), mode=ctypes.RTLD_GLOBAL)  # the kernel sets the harness calls
        library = build_dir / "attention_tile_bench.so"
        subprocess.run(
            ["g++", "-O2", "-std=c++17", "-shared", "-fPIC", f"-I{KERNEL_HEADERS}", str(HARNESS), "-o", str(library)],
            check=True,
        )
        self.library = ctypes.CDLL(str(library))
        self.library.bs_time_decode_tiles.restype = ctypes.c_int
        self.library.bs_time_decode_tiles.argtypes = (
            [ctypes.c_char_p, ctypes.c_char_p]
            + [ctypes.c_int] * 7
            + [
                ctypes.POINTER(ctypes.c_double),
                ctypes.POINTER(ctypes.c_float),
            ]
        )

    def time(
        self, kernels: str, cache_dtypes: list[str], keys: int, tiles: int, reps: int
    ) -> dict[str, tuple[float, np.ndarray]] | None:
        """Per cache dtype, nanoseconds per tile (the fastest pass; the dtypes' passes take turns) and the last
        tile's output [heads, head_dim]; None where this CPU does not run `kernels`."""
        ns = np.zeros(len(cache_dtypes), dtype=np.float64)
        outs = np.zeros((len(cache_dtypes), HEADS, HEAD_DIM), dtype=np.float32)
        status = self.library.bs_time_decode_tiles(
            kernels.encode(),
            ",".join(cache_dtypes).encode(),
            tiles,
            keys,
            reps,
            HEADS,
            KV_HEADS,
            HEAD_DIM,
            BLOCK_SIZE,
            ns.ctypes.data_as(ctypes.POINTER(ctypes.c_double)),
            outs.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
        )
        if status == -2:
            raise ValueError(f"a cache dtype of {cache_dtypes} is unknown")
        return None if status < 0 else {dtype: (ns[i], outs[i]) for i, dtype in enumerate(cache_dtypes)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, action="append", help=f"keys per tile (default {KEYS})")
    parser.add_argument(
        "--tiles", type=int, default=2, help="tiles per pass (few, so that their rows stay in the core's L2)"
    )
    parser.add_argument("--reps", type=int, default=2000, help="passes over the tiles; the fastest is quoted")
    parser.add_argument("--kernels", action="append", choices=KERNEL_SETS)
    parser.add_argument("--cache-dtype", action="append", choices=CACHE_DTYPES)
    args = parser.parse_args(argv)
    dtypes = args.cache_dtype or CACHE_DTYPES
    print(
        f"decode tile arithmetic, one thread, rows in L2: {HEADS} heads, {KV_HEADS} kv heads, head_dim {HEAD_DIM}, "
        f"{args.tiles} tiles, fastest of {args.reps} passes; ns per tile (vs the bf16 cache's)"
    )
    with tempfile.TemporaryDirectory() as build_dir:
        timer = TileTimer(Path(build_dir))
        for kernels in args.kernels or KERNEL_SETS:
            for keys in args.keys or KEYS:
                timed = timer.time(kernels, list(dtypes), keys, args.tiles, args.reps)
                if timed is None:
                    print(f"{kernels:<12} not on this CPU")
                    break
                reference = timed.get("bfloat16")
                cells = []
                for dtype, (ns, _) in timed.items():
                    ratio = f" ({ns / reference[0]:.2f}x)" if reference else ""
                    cells.append(f"{dtype} {ns:8.0f}{ratio}")
                print(f"{kernels:<12} keys {keys:>5}  " + "  ".join(cells))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
