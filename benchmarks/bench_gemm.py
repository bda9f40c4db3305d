"""fp32 GEMM rate (GFLOP/s) of the libraries the worker could use, on SmolLM2-135M's linear layers.

Run: OMP_NUM_THREADS=2 python benchmarks/bench_gemm.py [--trials N] [--amx | --onednn] [--rows M ...]

y[M, N] = x[M, K] @ W[K, N] for M tokens (decode batches 1-64, a 512-token prefill) against the
fused q|k|v, o, gate|up, down and lm_head weights. Weights are constant, so every candidate that can
pack or reorder them does so once per (M, weight), outside the timing:
- paddle: paddle.matmul (the pure-Paddle path's F.linear);
- torch: torch.matmul (the issue's "matmul floor");
- torch oneDNN packed: torch's oneDNN matmul over weights reordered into oneDNN's blocked layout
  (mkldnn._reorder_linear_weight + _linear_pointwise). Paddle's wheel ships libdnnl.so.3 (3.6.2) but
  only forwarding headers for it (dnnl.h includes oneapi/dnnl/dnnl.h, which the wheel lacks), so
  torch's oneDNN stands in for "oneDNN with packed weights";
- torch MKL packed: MKL's packed sgemm through torch (mkl._mkl_reorder_linear_weight + _mkl_linear);
- paddle mklml packed: cblas_sgemm_pack/compute of the MKL that Paddle's wheel ships (libmklml_intel.so);
- bs_linear: blockserve's own op (custom_ops/cpu/linear*), AVX2 forced.
Each figure is the best of --trials timed runs, the candidates taking turns (the machine may be shared).

--amx (on a CPU with AMX): instead, bs_linear's GEMM in the weight formats with dot products (BF16, INT8, Q4_1:
what a GGUF Q4_K is regrouped into) on AVX512-BF16/VNNI (BLOCKSERVE_CPU_ISA=avx512+bf16+vnni) and on AMX's tiles
(auto), the two taking turns, and the ratio of their rates; beside them oneDNN's bf16 matmul through PyTorch
(torch.nn.functional.linear on bf16 tensors, torch.set_num_threads(OMP_NUM_THREADS): `brg_matmul` on AMX where the
CPU has it, as ONEDNN_VERBOSE=1 shows), which a route to oneDNN for bf16 weights would reach, and AMX / oneDNN.
--rows sets the row counts (default: 1, 8, 16, 32, 64, 512).

--onednn (on a CPU with AVX512-BF16): bs_linear's bf16 weights on its own kernels and routed to oneDNN's matmul (the
route the worker measures at start, layers/gemm_route.py: custom_ops/cpu/linear_onednn.h, the library in Paddle's
wheel, one part of the GEMM on each thread), the two taking turns, and oneDNN / own rate; --rows as for --amx.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import torch  # noqa: E402

from worker.host.cpu_memory import keep_freed_memory  # noqa: E402
from worker.kernels.selection import select_kernels  # noqa: E402
from worker.layers.linear import linear  # noqa: E402
from worker.layers.precision import Precision  # noqa: E402
from worker.layers.weight_format import GgufBlocks, WeightFormat  # noqa: E402

ROWS = (1, 8, 16, 32, 64, 512)
WEIGHTS = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}
TRIAL_SECONDS = 0.02


class PaddleMklml:
    """MKL's packed sgemm from the libmklml_intel.so in Paddle's wheel, through ctypes."""

    ROW_MAJOR, NO_TRANS, B_MATRIX, PACKED = 101, 111, 162, 151

    def __init__(self):
        libs = Path(paddle.__file__).parent / "libs"
        ctypes.CDLL(str(libs / "libiomp5.so"), mode=ctypes.RTLD_GLOBAL)
        self.mkl = ctypes.CDLL(str(libs / "libmklml_intel.so"))
        self.mkl.cblas_sgemm_pack_get_size.restype = ctypes.c_size_t

    def prepare(self, x: np.ndarray, weight: np.ndarray):
        (m, k), n = x.shape, weight.shape[1]
        size = self.mkl.cblas_sgemm_pack_get_size(self.B_MATRIX, m, n, k)
        packed = np.empty(size // 4 + 1, np.float32)
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.mkl.cblas_sgemm_pack(
            self.ROW_MAJOR, self.B_MATRIX, self.NO_TRANS, m, n, k, one, pointer(weight), n, pointer(packed)
        )
        y = np.empty((m, n), np.float32)
        args = (self.ROW_MAJOR, self.NO_TRANS, self.PACKED, m, n, k, pointer(x), k, pointer(packed), n, zero)
        return lambda: self.mkl.cblas_sgemm_compute(*args, pointer(y), n), lambda: y


def pointer(array: np.ndarray):
    return array.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


def candidates(x: np.ndarray, weight: np.ndarray, custom, mklml: PaddleMklml) -> dict:
    """name -> (run, result) with everything packed; result() gives the last run's y as NumPy."""
    m = x.shape[0]
    px, pw = paddle.to_tensor(x), paddle.to_tensor(weight)
    tx, tw = torch.from_numpy(x), torch.from_numpy(weight)
    tw_t = tw.T.contiguous()  # [N, K], torch's linear layout
    dnnl_weight = torch.ops.mkldnn._reorder_linear_weight(tw_t, m)
    mkl_weight = torch.ops.mkl._mkl_reorder_linear_weight(tw_t, m)
    layer = linear(custom, np.ascontiguousarray(weight.T), None, Precision("float32", "none", "bench_gemm"))
    out = {}

    def keep(name, function, to_numpy):
        last = {}
        out[name] = (lambda: last.__setitem__("y", function()), lambda: to_numpy(last["y"]))

    keep("paddle", lambda: paddle.matmul(px, pw), lambda y: y.numpy())
    keep("torch", lambda: torch.matmul(tx, tw), lambda y: y.numpy())
    keep(
        "torch oneDNN packed",
        lambda: torch.ops.mkldnn._linear_pointwise(tx, dnnl_weight, None, "none", [], ""),
        lambda y: y.numpy(),
    )
    keep("torch MKL packed", lambda: torch.ops.mkl._mkl_linear(tx, mkl_weight, tw_t, None, m), lambda y: y.numpy())
    out["paddle mklml packed"] = mklml.prepare(x, weight)
    keep("bs_linear", lambda: layer(px), lambda y: y.numpy())
    return out


def best_seconds(runs: dict, trials: int) -> dict[str, float]:
    """Best seconds per call of each run, the runs taking turns trial by trial."""
    repeats = {}
    for name, run in runs.items():
        run()
        started = time.perf_counter()
        run()
        repeats[name] = max(1, int(TRIAL_SECONDS / max(time.perf_counter() - started, 1e-6)))
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(trials):
        for name, run in runs.items():
            started = time.perf_counter()
            for _ in range(repeats[name]):
                run()
            best[name] = min(best[name], (time.perf_counter() - started) / repeats[name])
    return best


# --amx: the formats timed, as (dtype, quantization) of their Precision.
AMX_FORMATS = {"bf16": ("bfloat16", "none"), "int8": ("float32", "int8"), "q4_1": ("float32", "gguf")}


def format_layer(kernels, format_name: str, weight: np.ndarray):
    """bs_linear of an [in, out] weight in one of AMX_FORMATS."""
    dtype, quantization = AMX_FORMATS[format_name]
    precision = Precision(dtype, quantization, "bench_gemm")
    if quantization == "gguf":
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        blocks = quantize(np.ascontiguousarray(weight.T), GGMLQuantizationType.Q4_1)
        return linear(kernels, GgufBlocks(WeightFormat.Q4_1, blocks, weight.shape[0]), None, precision)
    return linear(kernels, np.ascontiguousarray(weight.T), None, precision)


def onednn_bf16(x: paddle.Tensor, weight: np.ndarray):
    """y = x @ weight in bf16 through PyTorch's oneDNN matmul, as a run for best_seconds."""
    tx = torch.from_numpy(x.numpy()).to(torch.bfloat16)
    tw = torch.from_numpy(np.ascontiguousarray(weight.T)).to(torch.bfloat16)
    return lambda: torch.nn.functional.linear(tx, tw)


def amx_table(trials: int, formats: list[str], rows: tuple[int, ...]) -> None:
    """GFLOP/s of bs_linear per format (of AMX_FORMATS) on AVX512-BF16/VNNI and on AMX, and new / old; and of
    oneDNN's bf16 matmul (PyTorch's), and AMX / oneDNN."""
    paths = {"dot products": select_kernels("custom", isa_cap="avx512+bf16+vnni").kernels}
    paths["amx"] = select_kernels("custom", isa_cap="all").kernels
    if not paths["amx"].isa.amx:
        raise SystemExit("--amx: this CPU has no AMX (or Linux does not grant this process its tiles)")
    rng = np.random.default_rng(0)
    print(f"bs_linear GFLOP/s, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, best of {trials}")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    print(
        f"{'format':<7}{'weight':<9}{'M x K x N':>18}{'dot products':>14}{'amx':>10}{'amx / dot':>11}"
        f"{'onednn bf16':>13}{'amx / onednn':>14}"
    )
    for format_name in formats:
        for weight_name, (k, n) in WEIGHTS.items():
            weight = rng.standard_normal((k, n), dtype=np.float32)
            layers = {name: format_layer(kernels, format_name, weight) for name, kernels in paths.items()}
            for m in rows:
                x = paddle.to_tensor(rng.standard_normal((m, k), dtype=np.float32))
                runs = {name: (lambda layer=layer: layer(x)) for name, layer in layers.items()}
                runs["onednn bf16"] = onednn_bf16(x, weight)
                seconds = best_seconds(runs, trials)
                rates = {name: 2 * m * k * n / seconds[name] / 1e9 for name in runs}
                print(
                    f"{format_name:<7}{weight_name:<9}{f'{m} x {k} x {n}':>18}{rates['dot products']:>14.1f}"
                    f"{rates['amx']:>10.1f}{rates['amx'] / rates['dot products']:>10.2f}x"
                    f"{rates['onednn bf16']:>13.1f}{rates['amx'] / rates['onednn bf16']:>13.2f}x",
                    flush=True,
                )


def onednn_table(trials: int, rows: tuple[int, ...]) -> None:
    """GFLOP/s of bs_linear's bf16 weights on its kernels and on oneDNN's matmul (the worker's route), and the ratio."""
    from worker.layers.gemm_route import onednn_version, routed

    kernels = select_kernels("custom").kernels
    if not kernels.isa.bf16:
        raise SystemExit("--onednn: this CPU has no AVX512-BF16")
    version = onednn_version(kernels)
    if version == (0, 0, 0):
        raise SystemExit("--onednn: the custom ops were built without oneDNN (Paddle's wheel has no libdnnl.so.3)")
    paths = {"own": routed(kernels, 0), "onednn": routed(kernels, 1)}
    rng = np.random.default_rng(0)
    print(
        f"bs_linear bf16 GFLOP/s on {kernels.isa.name}, oneDNN {'.'.join(map(str, version))}, "
        f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, best of {trials}"
    )
    print(f"{'weight':<9}{'M x K x N':>18}{'own':>10}{'onednn':>10}{'onednn / own':>14}")
    for weight_name, (k, n) in WEIGHTS.items():
        weight = rng.standard_normal((k, n), dtype=np.float32)
        layers = {name: format_layer(path, "bf16", weight) for name, path in paths.items()}
        for m in rows:
            x = paddle.to_tensor(rng.standard_normal((m, k), dtype=np.float32))
            seconds = best_seconds({name: (lambda layer=layer: layer(x)) for name, layer in layers.items()}, trials)
            rates = {name: 2 * m * k * n / seconds[name] / 1e9 for name in layers}
            print(
                f"{weight_name:<9}{f'{m} x {k} x {n}':>18}{rates['own']:>10.1f}{rates['onednn']:>10.1f}"
                f"{rates['onednn'] / rates['own']:>13.2f}x",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--amx", action="store_true", help="bs_linear's formats without and with AMX's tiles")
    parser.add_argument("--formats", nargs="*", choices=list(AMX_FORMATS), default=list(AMX_FORMATS), help="of --amx")
    parser.add_argument("--onednn", action="store_true", help="bf16 weights on bs_linear's kernels and on oneDNN's")
    parser.add_argument("--rows", nargs="*", type=int, default=list(ROWS), help="of --amx, --onednn: the rows of x")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    keep_freed_memory()  # as the worker does: a large output is not fresh pages each call (page faults timed)
    if args.amx:
        amx_table(args.trials, args.formats, tuple(args.rows))
        return
    if args.onednn:
        onednn_table(args.trials, tuple(args.rows))
        return
    custom = select_kernels("custom", isa_cap="avx2").kernels
    mklml = PaddleMklml()
    rng = np.random.default_rng(0)
    names = None
    for weight_name, (k, n) in WEIGHTS.items():
        weight = rng.standard_normal((k, n), dtype=np.float32)
        for m in ROWS:
            x = rng.standard_normal((m, k), dtype=np.float32)
            runs = candidates(x, weight, custom, mklml)
            expected = x.astype(np.float64) @ weight
            for name, (run, result) in runs.items():
                run()
                np.testing.assert_allclose(result(), expected, rtol=1e-3, atol=1e-3 * np.sqrt(k), err_msg=name)
            seconds = best_seconds({name: run for name, (run, _) in runs.items()}, args.trials)
            if names is None:
                names = list(runs)
                print(f"GFLOP/s, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, best of {args.trials}")
                print(f"{'weight':<9}{'M x K x N':>18}" + "".join(f"{name:>21}" for name in names))
            rates = [2 * m * k * n / seconds[name] / 1e9 for name in names]
            print(f"{weight_name:<9}{f'{m} x {k} x {n}':>18}" + "".join(f"{rate:>21.1f}" for rate in rates), flush=True)


if __name__ == "__main__":
    main()
