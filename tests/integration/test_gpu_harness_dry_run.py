"""scripts/gpu_check.sh's Python, dry-run on this CPU so that a GPU session does not spend its time on
a slip: the GPU harness over a stand-in for CuPy (NumPy arrays, host pointers) and the emulated
kernels. It proves the harness's plumbing only; the kernels' GPU results need a GPU."""

from __future__ import annotations

import ctypes
import json
import sys
import time
import types

import numpy as np
import pytest

import tests.gpu.bench_kernels as bench
import tests.gpu.check_kernels as check_kernels
import tests.gpu.gpu_library as gpu_library_module
from tests.gpu.kernel_checks import GPU_ONLY_CHECKS, check_rope_write_kv, check_silu_and_mul, for_kv_cache


class HostBackedArray(np.ndarray):
    """A 'device' array: NumPy memory whose address stands for a device pointer."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)

    def set(self, host, stream=None):
        np.copyto(self, host)


def on_device(array) -> HostBackedArray:
    return np.array(array).view(HostBackedArray)


class Event:
    def record(self):
        self.at = time.perf_counter()

    def synchronize(self):
        pass


def fake_cupy() -> types.ModuleType:
    """What the harness uses of CuPy, in host memory."""
    rng = np.random.default_rng(0)
    stream = types.SimpleNamespace(ptr=0, synchronize=lambda: None)
    runtime = types.SimpleNamespace(
        CUDARuntimeError=RuntimeError,
        getDeviceCount=lambda: 1,
        getDeviceProperties=lambda device: {"name": b"host stand-in"},
        memcpyDeviceToDevice=3,
        memcpyAsync=lambda dst, src, size, kind, stream: ctypes.memmove(dst, src, size),
    )
    cuda = types.SimpleNamespace(
        Device=lambda *args: types.SimpleNamespace(
            id=0, compute_capability="90", attributes={"MultiProcessorCount": 4}
        ),
        runtime=runtime,
        Event=Event,
        get_elapsed_time=lambda start, end: (end.at - start.at) * 1e3,
        get_current_stream=lambda: stream,
        alloc_pinned_memory=bytearray,
    )
    module = types.ModuleType("cupy")
    module.__dict__.update(
        cuda=cuda,
        asarray=on_device,
        asnumpy=np.array,
        zeros=lambda shape, dtype: on_device(np.zeros(shape, dtype)),
        empty=lambda shape, dtype: on_device(np.zeros(shape, dtype)),
        random=types.SimpleNamespace(standard_normal=lambda shape, dtype: on_device(rng.standard_normal(shape, dtype))),
        get_default_memory_pool=lambda: types.SimpleNamespace(free_all_blocks=lambda: None),
        uint8=np.uint8,
        uint16=np.uint16,
        uint32=np.uint32,
        int64=np.int64,
        float32=np.float32,
    )
    return module


@pytest.fixture
def stand_in_gpu(monkeypatch, emulated_kernels):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    monkeypatch.setattr(gpu_library_module, "find_nvcc", lambda: "nvcc")
    monkeypatch.setattr(gpu_library_module, "build_cuda_library", lambda build_dir, nvcc, arch: emulated_kernels)


def test_the_kernel_checks_run_and_report_each_check_and_dtype(stand_in_gpu, monkeypatch, capsys):
    monkeypatch.setattr(check_kernels, "CHECKS", [check_silu_and_mul])
    monkeypatch.setattr(check_kernels, "GPU_ONLY_CHECKS", [])

    assert check_kernels.main() == 0

    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("check_")]
    assert [line.split()[:2] for line in lines] == [
        ["check_silu_and_mul", d] for d in ("float32", "bfloat16", "float16")
    ]
    assert all(line.endswith("PASS") for line in lines)


def test_the_kernel_checks_run_over_8bit_kv_caches_on_the_device_arrays(stand_in_gpu, monkeypatch, capsys):
    """The 8-bit caches' checks go through the harness as the others do (uint8 rows on the 'device'), and the
    GPU-only decode batch runs over each 8-bit cache too."""
    monkeypatch.setattr(check_kernels, "CHECKS", [for_kv_cache(check_rope_write_kv, "int8")])
    monkeypatch.setattr(check_kernels, "GPU_ONLY_CHECKS", [])

    assert check_kernels.main() == 0

    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("check_")]
    assert [line.split()[:2] for line in lines] == [
        ["check_rope_write_kv_int8_cache", d] for d in ("float32", "bfloat16", "float16")
    ]
    assert all(line.endswith("PASS") for line in lines)
    assert {check.__name__ for check in GPU_ONLY_CHECKS} >= {
        "check_paged_attention_decode_batch_int8_cache",
        "check_paged_attention_decode_batch_fp8_e4m3_cache",
    }


def test_the_benchmark_measures_every_case_and_writes_its_json(stand_in_gpu, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "GEOMETRIES", [("tiny", 4, 2, 16)])
    monkeypatch.setattr(bench, "SEQUENCES", (2, 3))
    monkeypatch.setattr(bench, "CONTEXT", 64)
    monkeypatch.setattr(bench, "COPY_BYTES", 2**20)
    timed = bench.device_seconds
    monkeypatch.setattr(bench, "device_seconds", lambda cupy, launch, repeats: timed(cupy, launch, 2))
    monkeypatch.setattr(sys, "argv", ["bench_kernels", "--json", str(tmp_path / "bench.json")])

    assert bench.main() == 0

    result = json.loads((tmp_path / "bench.json").read_text())
    assert [(row["model"], row["sequences"]) for row in result["attention"]] == [("tiny", 2), ("tiny", 3)]
    row = result["attention"][0]
    assert row["bytes"] >= 2 * 2 * 64 * 2 * 16 * 2  # K and V of 2 sequences x 64 tokens x 2 kv heads x 16, bf16
    assert row["fraction_of_copy"] == pytest.approx(row["bandwidth"] / result["copy_bandwidth"])
    assert result["step_inputs"]["requests"] == 256 and result["step_inputs"]["kernel_seconds"] > 0
    out = capsys.readouterr().out
    assert "copy bandwidth" in out and out.count("decode attention") == 2 and "step inputs for 256 requests" in out
