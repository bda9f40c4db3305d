"""Shared pieces of the integration tests: the SmolLM2 file, its transformers tokenizer, a scripted scheduler
with the real api in front of it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.contract.config import default_model_path
from tests.support.fake_scheduler import ApiServer, FakeScheduler


@pytest.fixture(scope="session", autouse=True)
def custom_ops_built():
    """The C++ ops built once, before any test starts a worker: a worker process then loads the cached build, so
    the tests' start-up limits time a start-up, not a cold compile (minutes on a busy 2-core machine)."""
    from worker.kernels.cpu_ops import load_ops
    from worker.kernels.op_build import CustomOpsUnavailable

    try:
        load_ops()
    except CustomOpsUnavailable:
        pass  # the fallback's own tests say what a worker does then


@pytest.fixture(scope="session")
def emulated_kernels(tmp_path_factory) -> Path:
    """kernel_api.cu built once by the host compiler with the SIMT emulation (tests/gpu/kernel_library.py), for
    the emulated kernel checks and the GPU harness's dry run."""
    import shutil

    from tests.gpu.kernel_library import build_emulated_library

    if shutil.which("g++") is None:
        pytest.skip("no g++ to build the emulated kernels")
    return build_emulated_library(tmp_path_factory.mktemp("emulated_kernels"))


@pytest.fixture(scope="module")
def stack():
    """A scripted scheduler and the real api app in front of it, shared by a test module."""
    with FakeScheduler() as fake, ApiServer(fake.addr) as api:
        api.wait_ready()
        yield fake, api


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    return Path(default_model_path())


@pytest.fixture(scope="session")
def hf_smollm_tokenizer(smollm_path):
    """transformers' tokenizer for the same GGUF: the reference for ours."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.fspath(smollm_path.parent), gguf_file=smollm_path.name)


@pytest.fixture(scope="session")
def hf_smollm_model(smollm_path):
    """transformers' float32 model of the same GGUF (read once: its dequantizing load takes ~10 s), in eval mode;
    no test may change it."""
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = os.fspath(smollm_path.parent), smollm_path.name
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
