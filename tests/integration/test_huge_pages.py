"""The worker's tensors moved into 2 MiB pages for real (madvise on this kernel), checked in /proc/self/smaps."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

from service.contract.config import load_settings
from tests.support.accuracy import paged_logits
from worker.host.cpu_memory import resident_anonymous_bytes
from worker.host.huge_pages import HUGE_PAGE_BYTES, TENSOR_ALIGNMENT, aligned_runs, collapse, move_into_one_buffer
from worker.model_runner import ModelRunner

REPO_ROOT = Path(__file__).resolve().parents[2]


def mappings_overlapping(start: int, end: int, fields: tuple[str, ...]) -> list[tuple[str, dict[str, str]]]:
    """(address range, {field: value}) of each mapping in /proc/self/smaps that overlaps [start, end)."""
    found, inside = [], False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and ":" not in first:
                low, high = (int(part, 16) for part in first.split("-"))
                inside = low < end and high > start
                if inside:
                    found.append((first, {}))
            elif inside and first.rstrip(":") in fields:
                found[-1][1][first.rstrip(":")] = " ".join(line.split()[1:])
    return found


def huge_bytes_in(start: int, end: int) -> int:
    """AnonHugePages of the mappings that overlap [start, end)."""
    mappings = mappings_overlapping(start, end, ("AnonHugePages",))
    return sum(int(values["AnonHugePages"].split()[0]) * 1024 for _, values in mappings)


def mappings_of(start: int, end: int) -> str:
    """The address range, AnonHugePages and THPeligible of each mapping that overlaps [start, end): what a failed
    check shows, to tell a page never collapsed from one split afterwards."""
    mappings = mappings_overlapping(start, end, ("AnonHugePages", "THPeligible"))
    shown = [f"{span} " + ", ".join(f"{name} {value}" for name, value in values.items()) for span, values in mappings]
    return f"run {start:#x}-{end:#x}: " + "; ".join(shown)


def spans(tensors):
    return [(t.data_ptr(), t.data_ptr() + int(t.numel()) * t.element_size()) for t in tensors]


class MappedBytes:
    """A fresh anonymous mapping of `size` bytes, written through, with the tensor methods collapse() reads."""

    def __init__(self, size: int):
        self.mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.array = np.frombuffer(self.mapping, dtype=np.uint8)
        self.array[:] = np.arange(size, dtype=np.uint64).astype(np.uint8)  # every page resident

    def data_ptr(self) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(self.mapping))

    def numel(self) -> int:
        return len(self.mapping)

    def element_size(self) -> int:
        return 1


def test_collapse_moves_the_whole_pages_of_fresh_memory_into_huge_pages_without_growing_resident_memory():
    buffers = [MappedBytes(9 * HUGE_PAGE_BYTES + 12345) for _ in range(2)]
    runs = aligned_runs(spans(buffers))
    assert sum(end - start for start, end in runs) >= 2 * 8 * HUGE_PAGE_BYTES
    assert all(huge_bytes_in(start, end) == 0 for start, end in runs)  # nothing advised them yet
    before = resident_anonymous_bytes()

    moved = collapse(buffers + buffers[:1])  # one named twice is moved once
    if moved.refused:
        pytest.skip(f"this kernel keeps 4 KiB pages here: {moved.refused}")

    assert moved.tensor_bytes == 2 * (9 * HUGE_PAGE_BYTES + 12345)
    assert moved.collapsed_bytes == sum(end - start for start, end in runs)
    for start, end in runs:
        assert huge_bytes_in(start, end) >= end - start, mappings_of(start, end)
    assert abs(resident_anonymous_bytes() - before) < HUGE_PAGE_BYTES  # no page became resident
    size = buffers[0].numel()
    assert np.array_equal(buffers[0].array, np.arange(size, dtype=np.uint64).astype(np.uint8))  # the same bytes
    buffers[1].array[:] = 7
    assert int(buffers[1].array.sum()) == 7 * size


def check_paddle_tensors_collapse() -> str:
    """Moves fresh Paddle tensors into 2 MiB pages and checks them; returns why the kernel refused, or ""."""
    tensors = [paddle.full([3 << 20], 1.5, dtype="float32") for _ in range(3)]  # 12 MiB each
    tensors.append(paddle.ones([5 << 20], dtype="bfloat16"))
    moved = collapse(tensors)
    if moved.refused:
        return moved.refused

    runs = aligned_runs(spans(tensors))
    assert moved.collapsed_bytes == sum(end - start for start, end in runs) >= 3 * 10 * (1 << 20)
    for start, end in runs:
        assert huge_bytes_in(start, end) >= end - start, mappings_of(start, end)
    assert float(tensors[0].sum()) == 1.5 * (3 << 20) and float(tensors[3].astype("float32").sum()) == 5 << 20
    tensors[1].fill_(2.0)
    assert float(tensors[1].mean()) == 2.0
    return ""


def test_collapse_moves_paddle_tensors_and_they_compute_as_before():
    # In a fresh process, as a worker moves its tensors: in this long-lived one the tensors can land in the heap
    # among earlier tests' memory, whose later changes split a mapping inside a run (seen once in the full suite:
    # a mapping boundary at an address no 2 MiB page can straddle).
    check = "from tests.integration.test_huge_pages import check_paddle_tensors_collapse as c; print('refused:', c())"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    (answer,) = [line for line in done.stdout.splitlines() if line.startswith("refused:")]
    if refused := answer.removeprefix("refused:").strip():
        pytest.skip(f"this kernel keeps 4 KiB pages here: {refused}")


def test_collapse_of_nothing_moves_nothing():
    assert collapse([]).collapsed_bytes == 0
    small = paddle.zeros([1000], dtype="float32")
    moved = collapse([small])
    assert (moved.tensor_bytes, moved.collapsed_bytes, moved.refused) == (4000, 0, "")


def test_tensors_moved_into_one_buffer_keep_their_values_and_lie_one_after_another_from_a_2_mib_boundary():
    tensors = [
        paddle.arange(3 << 18, dtype="float32").reshape([3, 1 << 18]),  # 3 MiB
        paddle.to_tensor(np.arange(1234567, dtype=np.uint64).astype(np.uint8)),
        paddle.linspace(-2.0, 2.0, 5 * 333).astype("bfloat16").reshape([5, 333]),
        paddle.arange(7, dtype="int64") * (1 << 40),
    ]
    expected = [tensor.astype("float64").numpy() for tensor in tensors]
    shapes = [tensor.shape for tensor in tensors]

    buffer = move_into_one_buffer(tensors + tensors[:1])  # one named twice is moved once

    assert [tensor.shape for tensor in tensors] == shapes
    assert all(np.array_equal(tensor.astype("float64").numpy(), want) for tensor, want in zip(tensors, expected))
    start, end = buffer.data_ptr(), buffer.data_ptr() + int(buffer.numel())
    placed = spans(tensors)
    assert placed[0][0] % HUGE_PAGE_BYTES == 0 and all(start <= low and high <= end for low, high in placed)
    for (_, high), (low, _) in zip(placed, placed[1:]):  # in order, each at the next aligned byte
        assert low % TENSOR_ALIGNMENT == 0 and 0 <= low - high < TENSOR_ALIGNMENT
    assert aligned_runs(placed) == [(placed[0][0], placed[-1][1] // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)]
    tensors[1].fill_(9)  # the tensor is its place in the buffer, not a copy of it
    offset = placed[1][0] - start
    assert np.all(buffer[offset : offset + 1234567].numpy() == 9) and float(tensors[0][2, 5]) == (2 << 18) + 5
    assert move_into_one_buffer([]) is None


def test_a_worker_on_a_cpu_holds_all_its_weights_in_one_run_of_2_mib_pages(smollm_path):
    runner = ModelRunner(load_settings(model=os.fspath(smollm_path), num_kv_blocks=16, dtype="bfloat16"))
    weights = runner.model.weight_tensors()
    weight_bytes = sum(int(tensor.numel()) * tensor.element_size() for tensor in weights)

    (run,) = aligned_runs(spans(weights))

    assert run[1] - run[0] > weight_bytes - HUGE_PAGE_BYTES  # all but the part of a page after the last
    if float(runner.kernels["huge_pages_mib"]) == 0:
        pytest.skip("this kernel keeps 4 KiB pages here (the worker's log says why)")
    assert huge_bytes_in(*run) >= run[1] - run[0], mappings_of(*run)


def test_a_worker_on_a_cpu_moves_its_kv_cache_into_2_mib_pages_on_a_thread_while_it_computes(smollm_path):
    runner = ModelRunner(load_settings(model=os.fspath(smollm_path), num_kv_blocks=512, dtype="bfloat16"))
    caches = runner.kv_cache.key_caches + runner.kv_cache.value_caches
    prompt = list(range(100, 400))
    logits_while_moving = paged_logits(runner, prompt, chunk_size=64)  # the move may still be going on

    runner.kv_cache_move.join(timeout=120)

    assert not runner.kv_cache_move.is_alive()
    np.testing.assert_array_equal(paged_logits(runner, prompt, chunk_size=64), logits_while_moving)
    (run,) = aligned_runs(spans(caches))  # one buffer from a 2 MiB boundary (KVCache's in_one_buffer)
    assert run[0] == min(start for start, _ in spans(caches))
    if runner.kv_cache_move.moved.refused:
        pytest.skip(f"this kernel keeps 4 KiB pages here: {runner.kv_cache_move.moved.refused}")
    start, end = run
    assert runner.kv_cache_move.moved.collapsed_bytes == end - start
    assert end - start > 0.9 * sum(span_end - span_start for span_start, span_end in spans(caches))
    assert huge_bytes_in(start, end) >= end - start, mappings_of(start, end)


def test_with_huge_pages_off_nothing_moves_the_kv_cache(smollm_path):
    settings = load_settings(model=os.fspath(smollm_path), num_kv_blocks=16, dtype="bfloat16", huge_pages=False)
    runner = ModelRunner(settings)
    assert runner.kv_cache_move is None and runner.kernels["huge_pages_mib"] == "0.0"
