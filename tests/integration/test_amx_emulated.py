"""The AMX kernel set on a CPU without AMX: the per-instruction-set kernel tests' AMX cases (`-k all`: the bf16,
int8 and GGUF GEMMs on tiles, the prompt attention on tiles, every cache type under the AMX set) run in a child
process whose op library emulates the tile instructions (custom_ops/cpu/amx_emulation.h, built under
BLOCKSERVE_TEST_AMX_EMULATION=1 in its own folder: 1.5-3 minutes on 2 cores, then about 20 s of tests). There every
AMX case must run and pass; in this process they skip, saying the CPU has no AMX. The emulation follows Intel's
pseudocode for tdpbf16ps and tdpbsud and traps where the hardware would fault (a tile not configured, shapes that do
not fit), so a wrong tile plan fails here; how fast the tiles are, and anything the pseudocode leaves out, needs an
AMX CPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from worker.kernels.cpu_isa import AMX_EMULATION_VARIABLE, IsaSet, cpu_features

REPO = Path(__file__).resolve().parents[2]
# The files of the per-instruction-set kernel tests (tests/support/isa_kernels.py's caps), whose "all" cases are AMX's.
KERNEL_TEST_FILES = [
    "tests/integration/test_custom_ops.py",
    "tests/integration/test_custom_linear.py",
    "tests/integration/test_custom_moe.py",
    "tests/integration/test_prefill_attention_on_tiles.py",
    "tests/integration/test_onednn_gemm.py",
    "tests/unit/test_sampler.py",
]
CHILD_TIMEOUT_S = 1500


def test_the_amx_kernel_cases_pass_with_the_tiles_emulated(monkeypatch):
    features = cpu_features()
    if IsaSet.of(features).amx:
        pytest.skip("the AMX cases ran in this process already: this CPU has AMX, or these ops emulate it")
    monkeypatch.setenv(AMX_EMULATION_VARIABLE, "1")  # for cpu_isa.has_amx here, and for the child, which inherits it
    if not IsaSet.of(features).amx:
        pytest.skip("the emulation runs the rest of the AMX kernel set natively: AVX512-BF16, VNNI and VBMI")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *KERNEL_TEST_FILES, "-k", "all"]

    child = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)

    output = child.stdout[-6000:] + child.stderr[-3000:]
    assert child.returncode == 0, output
    summary = child.stdout.strip().splitlines()[-1]
    counts = {word: int(number) for number, word in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
    # Each case asserts that its kernels are the AMX set (isa_kernels.custom_kernels_on): none may skip.
    assert counts.get("passed", 0) > 0 and set(counts) == {"passed"}, output
