"""The CUDA kernels' C entry points (custom_ops/gpu/kernel_api.cu) through ctypes, over one array backend:

- `CudaArrays`: CuPy device arrays, the library built by nvcc for this GPU (tests/gpu/, scripts/gpu_check.sh);
- `HostArrays`: NumPy arrays, the same source built by the host C++ compiler with the SIMT emulation
  (custom_ops/gpu/simt_emulation.h), so the CPU tests run the very same kernels.

Every call takes and returns NumPy arrays in the kernel's storage type (bfloat16 as uint16 bits, an 8-bit KV cache
as uint8 rows: worker/attention/kv_rows.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
GPU_SOURCES = ROOT / "custom_ops" / "gpu"
ENTRY_POINTS = GPU_SOURCES / "kernel_api.cu"
NVCC_FLAGS = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-shared", "-lineinfo", "-ftz=false"]  # as cuda_build's
EMULATION_FLAGS = ["-x", "c++", "-std=c++17", "-O2", "-fPIC", "-shared", "-fno-strict-aliasing"]
EMULATION_FLAGS += ["-Wno-unknown-pragmas"]  # #pragma unroll is for nvcc
EMULATION_FLAGS += ["-ffp-contract=off"]  # a * b + c rounds twice, as the kernels' __fmul_rn/__fadd_rn do on a GPU
PLAN_FIELDS = ("query_tile", "split_keys", "max_splits", "workspace_floats", "shared_bytes")


def sources_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(GPU_SOURCES.iterdir()):
        if path.suffix in (".cu", ".cuh", ".h"):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def build_library(out_dir: Path, command: list[str], name: str) -> Path:
    """Builds kernel_api.cu with `command` (compiler and flags) unless this source version is built."""
    library = out_dir / f"{name}_{sources_hash()}.so"
    if not library.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        partial = library.with_suffix(".partial")
        subprocess.run([*command, str(ENTRY_POINTS), "-o", str(partial)], check=True, cwd=GPU_SOURCES)
        partial.rename(library)
    return library


def build_emulated_library(out_dir: Path) -> Path:
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise FileNotFoundError("no C++ compiler (g++) for the emulated kernels")
    return build_library(out_dir, [compiler, *EMULATION_FLAGS], "libbs_kernels_emulated")


def build_cuda_library(out_dir: Path, nvcc: str, compute_capability: str) -> Path:
    """nvcc build for one architecture, e.g. compute_capability "90"."""
    arch = f"-gencode=arch=compute_{compute_capability},code=sm_{compute_capability}"
    return build_library(out_dir, [nvcc, *NVCC_FLAGS, arch], f"libbs_kernels_sm{compute_capability}")


class HostArrays:
    """NumPy memory for the emulated kernels."""

    name = "emulated"
    num_sms = 1  # as the emulation's multiprocessor_count says

    def put(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array).copy()

    def empty(self, shape, dtype) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def get(self, array: np.ndarray) -> np.ndarray:
        return np.array(array)

    @staticmethod
    def pointer(array: np.ndarray | None) -> int | None:
        return None if array is None else array.ctypes.data

    stream = None

    def synchronize(self) -> None:
        pass


class CudaArrays:
    """CuPy memory on the current device."""

    name = "cuda"

    def __init__(self):
        import cupy

        self.cupy = cupy
        self.num_sms = cupy.cuda.Device().attributes["MultiProcessorCount"]

    def put(self, array: np.ndarray):
        return self.cupy.asarray(np.ascontiguousarray(array))

    def empty(self, shape, dtype):
        return self.cupy.zeros(shape, dtype=dtype)

    def get(self, array) -> np.ndarray:
        return self.cupy.asnumpy(array)

    @staticmethod
    def pointer(array) -> int | None:
        return None if array is None else array.data.ptr

    @property
    def stream(self) -> int:
        return self.cupy.cuda.get_current_stream().ptr

    def synchronize(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()


STORAGE = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16}
DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}
KV_CACHE_CODES = {**DTYPE_CODES, "int8": 3, "fp8_e4m3": 4}  # a KV cache's: the activations' dtype, or 8-bit rows

i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
SIGNATURES = {
    "bs_add_rms_norm": [i32, ptr, ptr, ptr, ptr, ptr, i64, i64, f32, ptr],
    "bs_silu_and_mul": [i32, ptr, ptr, i64, i64, ptr],
    "bs_rope_write_kv": [i32, i32, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i32, i32, i32, ptr],
    "bs_plan_attention": [i64, i64, i64, i32, i32, i32, i32, i64, i32, i32, ptr],
    "bs_paged_attention": [i32, i32, *[ptr] * 8, i64, i64, i64, i32, i32, i32, i32, i64, f32, i32, i32, ptr],
    "bs_prepare_step_inputs": [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, *[ptr] * 6, ptr],
}


class KernelError(RuntimeError):
    pass


class KernelLibrary:
    """Each kernel as a function of NumPy arrays (copied to the backend and back)."""

    def __init__(self, path: Path, arrays: HostArrays | CudaArrays):
        self.lib = ctypes.CDLL(str(path))
        self.arrays = arrays
        for name, argtypes in SIGNATURES.items():
            getattr(self.lib, name).argtypes = argtypes
            getattr(self.lib, name).restype = ctypes.c_int
        self.lib.bs_last_error.restype = ctypes.c_char_p

    def _call(self, name: str, *args) -> None:
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise KernelError(f"{name}: {self.lib.bs_last_error().decode()} (status {status})")
        self.arrays.synchronize()

    def add_rms_norm(self, x, residual, weight, eps: float, dtype: str):
        """(out, summed); summed is None without a residual."""
        a = self.arrays
        x_d, w_d = a.put(x), a.put(weight)
        res_d = None if residual is None else a.put(residual)
        out_d = a.empty(x.shape, x.dtype)
        sum_d = None if residual is None else a.empty(x.shape, x.dtype)
        p = a.pointer
        self._call(
            "bs_add_rms_norm", DTYPE_CODES[dtype], p(x_d), p(res_d), p(w_d), p(out_d), p(sum_d), *x.shape, eps, a.stream
        )
        return a.get(out_d), None if sum_d is None else a.get(sum_d)

    def silu_and_mul(self, gate_up, dtype: str):
        a = self.arrays
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        src, out = a.put(gate_up), a.empty((rows, width), gate_up.dtype)
        self._call("bs_silu_and_mul", DTYPE_CODES[dtype], a.pointer(src), a.pointer(out), rows, width, a.stream)
        return a.get(out)

    def rope_write_kv(
        self,
        qkv,
        positions,
        cos,
        sin,
        slot_mapping,
        key_cache,
        value_cache,
        num_heads,
        num_kv_heads,
        dtype,
        kv_cache_dtype: str | None = None,
    ):
        """(query, key_cache, value_cache) after the kernel; the caches hold `kv_cache_dtype` (None: dtype)."""
        a = self.arrays
        head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
        num_slots = key_cache.shape[0] * key_cache.shape[1]
        d = {
            name: a.put(v)
            for name, v in dict(qkv=qkv, positions=positions, cos=cos, sin=sin, slots=slot_mapping).items()
        }
        keys, values = a.put(key_cache), a.put(value_cache)
        query = a.empty((len(positions), num_heads, head_dim), qkv.dtype)
        p = a.pointer
        self._call(
            "bs_rope_write_kv",
            DTYPE_CODES[dtype],
            KV_CACHE_CODES[kv_cache_dtype or dtype],
            *(p(d[name]) for name in ("qkv", "positions", "cos", "sin", "slots")),
            p(keys),
            p(values),
            p(query),
            len(positions),
            num_slots,
            cos.shape[0],
            num_heads,
            num_kv_heads,
            head_dim,
            a.stream,
        )
        return a.get(query), a.get(keys), a.get(values)

    def plan_attention(
        self,
        query_shape,
        num_requests: int,
        cache_shape,
        table_width: int,
        query_tile: int,
        num_sms: int,
        sliding_window: int = 0,
    ):
        """The kernel's plan (PLAN_FIELDS) for query [tokens, heads, dim] and caches [blocks, block_size, kv_heads, dim]."""
        plan = np.zeros(len(PLAN_FIELDS), dtype=np.int64)
        num_tokens, num_heads, head_dim = query_shape
        args = (num_tokens, num_requests, table_width, num_heads, cache_shape[2], head_dim, cache_shape[1])
        status = self.lib.bs_plan_attention(*args, sliding_window, query_tile, num_sms, plan.ctypes.data)
        if status != 0:
            raise KernelError(f"bs_plan_attention: {self.lib.bs_last_error().decode()}")
        return dict(zip(PLAN_FIELDS, plan.tolist()))

    def paged_attention_on_device(
        self,
        dtype: str,
        arrays: dict,
        query_tile: int,
        num_sms: int,
        sliding_window: int = 0,
        softcap: float = 0.0,
        kv_cache_dtype: str | None = None,
    ) -> None:
        """Launches on arrays already on the backend (query, key_cache, value_cache, query_start,
        context_lens, block_table, out, workspace); returns without waiting (the benchmark times it).
        sliding_window, softcap: 0 for none; kv_cache_dtype: what the caches hold (None: dtype)."""
        a = self.arrays
        names = ("query", "key_cache", "value_cache", "query_start", "context_lens", "block_table", "out", "workspace")
        num_tokens, num_heads, head_dim = arrays["query"].shape
        _, block_size, num_kv_heads, _ = arrays["key_cache"].shape
        status = self.lib.bs_paged_attention(
            DTYPE_CODES[dtype],
            KV_CACHE_CODES[kv_cache_dtype or dtype],
            *(a.pointer(arrays[name]) for name in names),
            num_tokens,
            len(arrays["context_lens"]),
            arrays["block_table"].shape[1],
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            sliding_window,
            softcap,
            query_tile,
            num_sms,
            a.stream,
        )
        if status != 0:
            raise KernelError(f"bs_paged_attention: {self.lib.bs_last_error().decode()} (status {status})")

    def put_attention_inputs(self, query, key_cache, value_cache, query_start, context_lens, block_table, plan) -> dict:
        """The attention's arrays on the backend, with room for its output and workspace."""
        a = self.arrays
        inputs = dict(
            query=query,
            key_cache=key_cache,
            value_cache=value_cache,
            query_start=query_start,
            context_lens=context_lens,
            block_table=block_table,
        )
        arrays = {name: a.put(value) for name, value in inputs.items()}
        arrays["out"] = a.empty((query.shape[0], query.shape[1] * query.shape[2]), query.dtype)
        arrays["workspace"] = a.empty(max(plan["workspace_floats"], 1), np.float32)
        return arrays

    def paged_attention(
        self,
        query,
        key_cache,
        value_cache,
        query_start,
        context_lens,
        block_table,
        query_tile,
        dtype,
        num_sms,
        sliding_window: int = 0,
        softcap: float = 0.0,
        kv_cache_dtype: str | None = None,
    ):
        """(output [tokens, heads * dim], the plan it ran with)."""
        plan = self.plan_attention(
            query.shape, len(context_lens), key_cache.shape, block_table.shape[1], query_tile, num_sms, sliding_window
        )
        arrays = self.put_attention_inputs(query, key_cache, value_cache, query_start, context_lens, block_table, plan)
        self.paged_attention_on_device(dtype, arrays, query_tile, num_sms, sliding_window, softcap, kv_cache_dtype)
        self.arrays.synchronize()
        return self.arrays.get(arrays["out"]), plan

    def prepare_step_inputs(self, delta, block_tables, last_sampled, block_size: int):
        """(outputs by name, block_tables after) for a worker.inputs.step_delta.StepDelta."""
        a = self.arrays
        num_tokens, num_requests, width = delta.num_tokens, delta.num_requests, delta.table_width
        packed, tables, sampled = a.put(delta.packed), a.put(block_tables), a.put(last_sampled)
        shapes = {
            "input_ids": num_tokens,
            "positions": num_tokens,
            "slot_mapping": num_tokens,
            "query_start": num_requests + 1,
            "context_lens": num_requests,
            "block_table": (num_requests, width),
        }
        outs = {name: a.empty(shape, np.int64) for name, shape in shapes.items()}
        self.prepare_step_inputs_on_device(packed, num_requests, num_tokens, tables, sampled, block_size, width, outs)
        a.synchronize()
        return {name: a.get(v) for name, v in outs.items()}, a.get(tables)

    def prepare_step_inputs_on_device(self, packed, num_requests, num_tokens, tables, sampled, block_size, width, outs):
        a = self.arrays
        status = self.lib.bs_prepare_step_inputs(
            a.pointer(packed),
            num_requests,
            num_tokens,
            a.pointer(tables),
            tables.shape[1],
            tables.shape[0],
            a.pointer(sampled),
            block_size,
            width,
            *(
                a.pointer(outs[name])
                for name in ("input_ids", "positions", "slot_mapping", "query_start", "context_lens", "block_table")
            ),
            a.stream,
        )
        if status != 0:
            raise KernelError(f"bs_prepare_step_inputs: {self.lib.bs_last_error().decode()} (status {status})")
