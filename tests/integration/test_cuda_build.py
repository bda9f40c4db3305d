"""The CUDA ops build: every Paddle-free .cu compiles with this machine's nvcc for each architecture
the image targets, the Paddle glue compiles against Paddle's own headers, and the GPU ops carry the
CPU ops' names and signatures. Nothing built here can run here (no GPU): tests/gpu/ runs them."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CUSTOM_OPS = ROOT / "custom_ops"


def _cuda_build():
    spec = importlib.util.spec_from_file_location("blockserve_cuda_build", CUSTOM_OPS / "cuda_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cuda_build = _cuda_build()


def nvcc() -> str:
    found = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if Path(p).exists()), None)
    if found is None:
        pytest.skip("nvcc is not installed")
    return found


# One nvcc call for every architecture, compiled side by side (--threads 0: one per core): on a 2-core VM 17 s, where a
# call for each took 16 s apiece. A warning under one architecture alone fails the call (tried with an unused variable
# under __CUDA_ARCH__ == 900); its message names the line, not the architecture.
@pytest.mark.parametrize("source", cuda_build.paddle_free_sources(), ids=lambda path: Path(path).name)
def test_every_paddle_free_cuda_source_compiles_with_nvcc_for_every_architecture_without_warnings(source, tmp_path):
    command = [
        nvcc(),
        *cuda_build.NVCC_FLAGS,
        *cuda_build.gencode_flags(list(cuda_build.DEFAULT_ARCHITECTURES)),
        "--threads",
        "0",
        "-Werror=all-warnings",
        "-c",
        source,
        "-o",
        str(tmp_path / "kernels.o"),
    ]
    built = subprocess.run(command, capture_output=True, text=True, cwd=cuda_build.SOURCE_DIR)
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "kernels.o").stat().st_size > 0


def test_the_paddle_free_sources_are_the_c_entry_points_and_include_every_kernel_header():
    (entry_points,) = cuda_build.paddle_free_sources()
    headers = {path.name for path in cuda_build.SOURCE_DIR.glob("*_kernels.cuh")}
    included = set(re.findall(r'#include "(\w+_kernels\.cuh)"', Path(entry_points).read_text()))
    assert Path(entry_points).name == "kernel_api.cu" and headers and included == headers


@pytest.mark.parametrize("source", cuda_build.op_sources(), ids=lambda path: Path(path).name)
def test_paddle_ops_compile_against_paddles_own_headers(source):
    """Syntax and types of the glue, checked with this machine's (CPU) Paddle headers: its CUDA
    headers need cuBLAS and cuDNN, which are not here, so the glue is compiled as C++ with the SIMT
    emulation for the kernels, and Paddle's custom-device branch provides Tensor::stream()."""
    from paddle.utils.cpp_extension.extension_utils import find_paddle_includes

    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++")
    includes = [*find_paddle_includes(use_cuda=False), sysconfig.get_paths()["include"], str(cuda_build.SOURCE_DIR)]
    command = [compiler, "-x", "c++", "-std=c++17", "-fsyntax-only", "-fopenmp", "-Wno-unknown-pragmas"]
    command += ["-DPADDLE_WITH_CUSTOM_DEVICE", *(f"-I{path}" for path in includes), source]
    checked = subprocess.run(command, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr[-4000:]


def registered_ops(sources: list[Path], isa_attr: str = "") -> dict[str, tuple[str, ...]]:
    """PD_BUILD_OP name -> its Inputs, Outputs and Attrs as written (the glue's BS_ISA_ATTR spelled out)."""
    ops = {}
    for source in sources:
        text = source.read_text().replace("BS_ISA_ATTR", isa_attr)
        for name, body in re.findall(r"PD_BUILD_OP\((\w+)\)(.*?);", text, re.S):
            ops[name] = tuple(
                re.sub(r"\s+", "", part) for part in re.findall(r"\.(?:Inputs|Outputs|Attrs)\((.*?)\)", body)
            )
    return ops


def test_gpu_ops_have_the_cpu_ops_names_and_signatures():
    isa_attr = re.search(r'#define BS_ISA_ATTR (".*")', (cuda_build.SOURCE_DIR / "paddle_glue.h").read_text()).group(1)
    cpu = registered_ops(sorted((CUSTOM_OPS / "cpu").glob("*.cc")))
    gpu = registered_ops([Path(source) for source in cuda_build.op_sources()], isa_attr)
    shared = {"bs_rope_write_kv", "bs_paged_attention", "bs_rms_norm", "bs_add_rms_norm", "bs_silu_and_mul"}
    assert {name: cpu[name] for name in shared} == {name: gpu[name] for name in shared}
    # Linear layers are Paddle's matmul on a GPU, a decoder layer runs op by op there, and sampling takes
    # Paddle's CUDA argmax and draw (only their CPU kernels are single-threaded); a grammar's mask is Paddle's
    # `where` there (the CUDA kernels' mask_rows); a mixture of experts' experts are Paddle's loop there.
    cpu_only = {
        "bs_mask_rows",
        "bs_moe_experts",
        "bs_linear_pack",
        "bs_linear_pack_int8",
        "bs_linear_pack_gguf",
        "bs_linear",
        "bs_linear_columns",
        "bs_linear_onednn_version",  # which oneDNN the CPU GEMMs of bf16 weights may run on
        "bs_argmax_rows",
        "bs_sample_rows",
    }
    assert set(cpu) - shared == cpu_only | {"bs_decoder_stack", "bs_decoder_stack_hold", "bs_decoder_stack_release"}
    assert set(gpu) - shared == {"bs_prepare_step_inputs"}


def test_architectures_default_to_sm80_and_sm90_and_follow_the_build_variable(monkeypatch):
    monkeypatch.delenv(cuda_build.ARCHITECTURES_VARIABLE, raising=False)
    assert cuda_build.gencode_flags(cuda_build.architectures()) == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
    ]
    monkeypatch.setenv(cuda_build.ARCHITECTURES_VARIABLE, "90; 100")
    assert cuda_build.architectures() == ["90", "100"]
    assert 'CUDA_ARCHS="80;90"' in (ROOT / "Dockerfile").read_text()


def test_setup_builds_the_cuda_ops_on_a_cuda_paddle(monkeypatch, tmp_path):
    """setup.py hands Paddle a CUDAExtension of the glue with both architectures' flags."""
    import paddle
    import paddle.utils.cpp_extension as cpp_extension

    calls = {}
    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    monkeypatch.setattr(cpp_extension, "CUDAExtension", lambda **kwargs: kwargs)
    monkeypatch.setattr(cpp_extension, "setup", lambda **kwargs: calls.update(kwargs))
    monkeypatch.syspath_prepend(str(CUSTOM_OPS))
    for module in ("build", "cuda_build"):  # setup.py's own imports, found beside it and forgotten after
        monkeypatch.setitem(sys.modules, module, sys.modules.get(module))
        del sys.modules[module]
    spec = importlib.util.spec_from_file_location("blockserve_setup", CUSTOM_OPS / "setup.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert calls["name"] == "blockserve_cuda_ops"
    extension = calls["ext_modules"]
    assert [Path(s).name for s in extension["sources"]] == [
        "attention_ops.cu",
        "elementwise_ops.cu",
        "step_input_ops.cu",
    ]
    assert {"-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"} <= set(
        extension["extra_compile_args"]["nvcc"]
    )
