"""2 MiB pages for the worker's long-lived CPU memory: the weights and the KV cache.

A decode step reads every weight and its requests' KV blocks once: hundreds of MB, which on 4 KiB pages
means a TLB miss every 4 KiB (a two-level page walk under a hypervisor) and hardware prefetchers that stop at
each page's end. Linux backs anonymous memory with 2 MiB pages (transparent huge pages) only where its THP
mode is `always`, or `madvise` (Debian's and Ubuntu's default) for ranges advised so, and Paddle's allocator
advises nothing. After loading, the worker advises the 2 MiB-aligned runs of these tensors' memory
(MADV_HUGEPAGE) and has the kernel move them into 2 MiB pages at once (MADV_COLLAPSE, Linux 6.1 and later).
Only runs that the tensors fill whole are touched (adjacent tensors merged across the allocator's headers
between them), so no page becomes resident that was not. Where the kernel refuses (older kernels, THP off,
no free 2 MiB pages) the memory stays as it was and the log says so.
The worker moves its weights before it registers and its KV cache on a thread while it serves (startup.py).

The weights are first copied into one buffer that begins on a 2 MiB boundary (move_into_one_buffer): allocated one
by one, a model's ~180 tensors of 0.6-3.5 MB lie between the allocator's other blocks, and only 43-81% of their
bytes (SmolLM2-135M, by precision) were in whole 2 MiB pages of runs of them; in one buffer, all of them are.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

log = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
TENSOR_ALIGNMENT = 64  # bytes between the starts of tensors in one buffer: a cache line, a multiple of any element
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
COLLAPSE_TRIES = 4  # asks per run while the kernel answers EAGAIN
# Tensors this close are one run: what lies between is an allocator header inside pages they both fill.
MAX_GAP_BYTES = 4096


@dataclass(frozen=True)
class HugePages:
    tensor_bytes: int  # the tensors' bytes
    collapsed_bytes: int  # of them, in 2 MiB pages now
    refused: str  # why the kernel refused a run ("" if it took every one)


def aligned_runs(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The 2 MiB-aligned [start, end) ranges inside runs of byte ranges [start, end) that touch or nearly do."""
    runs: list[list[int]] = []
    for start, end in sorted(spans):
        if runs and start - runs[-1][1] <= MAX_GAP_BYTES:
            runs[-1][1] = max(runs[-1][1], end)
        else:
            runs.append([start, end])
    aligned = []
    for start, end in runs:
        first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        if last > first:
            aligned.append((first, last))
    return aligned


def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _advise(madvise, start: int, end: int, advice: int) -> int:
    """0, or the errno of the advice on [start, end); a collapse the kernel calls transient (EAGAIN: a page
    locked or referenced elsewhere for the moment) is asked for again, a few times."""
    for _ in range(COLLAPSE_TRIES):
        if madvise(start, end - start, advice) == 0:
            return 0
        code = ctypes.get_errno()
        if code != errno.EAGAIN:
            return code
    return code


def tensor_spans(tensors: Iterable) -> list[tuple[int, int]]:
    """The byte ranges [start, end) of `tensors` (Paddle CPU tensors, each counted once), empty ones left out."""
    spans = []
    for tensor in {id(tensor): tensor for tensor in tensors}.values():
        size = int(tensor.numel()) * tensor.element_size()
        if size > 0:
            spans.append((tensor.data_ptr(), tensor.data_ptr() + size))
    return spans


def collapse(tensors: Iterable) -> HugePages:
    """Moves the aligned runs of `tensors`' memory (Paddle CPU tensors, each counted once) into 2 MiB pages."""
    return collapse_spans(tensor_spans(tensors))


def collapse_spans(spans: list[tuple[int, int]]) -> HugePages:
    """Moves the aligned runs of the byte ranges `spans` into 2 MiB pages. Touches no Python object but the
    numbers: it may run on a thread of its own while the memory is read and written (the kernel moves a page's
    bytes under its lock, as khugepaged does for any process)."""
    tensor_bytes = sum(end - start for start, end in spans)
    if not sys.platform.startswith("linux"):  # the advice numbers are Linux's
        return HugePages(tensor_bytes, 0, f"not Linux ({sys.platform})")
    madvise = _madvise()
    collapsed, refused = 0, ""
    for start, end in aligned_runs(spans):
        for advice, name in ((MADV_HUGEPAGE, "MADV_HUGEPAGE"), (MADV_COLLAPSE, "MADV_COLLAPSE")):
            code = _advise(madvise, start, end, advice)
            if code != 0:
                refused = f"{name}: {errno.errorcode.get(code, code)} ({os.strerror(code)})"
                break
        else:
            collapsed += end - start
    return HugePages(tensor_bytes, collapsed, refused)


class BackgroundCollapse(threading.Thread):
    """collapse_spans(spans) on a thread of its own (made at `started_s`); `moved` holds its HugePages once it has
    run."""

    def __init__(self, spans: list[tuple[int, int]], name: str):
        super().__init__(name=name, daemon=True)
        self.spans = spans
        self.started_s = time.perf_counter()
        self.moved: HugePages | None = None

    def run(self) -> None:
        self.moved = collapse_spans(self.spans)


def move_into_one_buffer(tensors: Iterable):
    """Copies `tensors` (Paddle CPU tensors, each counted once) one after another into a new uint8 buffer that
    begins on a 2 MiB boundary, each at a multiple of TENSOR_ALIGNMENT bytes, and points each tensor at its copy,
    so that its old memory is freed (to the allocator: cpu_memory.release_freed_memory gives it back). Every
    reference to a tensor sees the copy; a different tensor that shared its memory (a view) would not. Returns
    the buffer (the tensors keep it alive), or None where there is nothing to move."""
    import paddle

    unique = [tensor for tensor in {id(tensor): tensor for tensor in tensors}.values() if int(tensor.numel()) > 0]
    if not unique:
        return None
    offsets, end = [], 0
    for tensor in unique:
        if not tensor.place.is_cpu_place():
            raise ValueError(f"only CPU tensors move into one buffer, not one on {tensor.place}")
        offsets.append(end)
        end += -(-int(tensor.numel()) * tensor.element_size() // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT
    buffer = paddle.empty([end + HUGE_PAGE_BYTES], dtype="uint8")
    start = -buffer.data_ptr() % HUGE_PAGE_BYTES  # a multiple of the allocator's alignment, so of every element
    by_dtype = {paddle.uint8: buffer}  # the buffer as each dtype: a view of the whole, sliced after (a slice first
    # viewed as another dtype addressed its elements from the wrong offset in Paddle 3.3)
    for tensor, offset in zip(unique, offsets):
        whole = by_dtype.setdefault(tensor.dtype, buffer.view(tensor.dtype))
        first = (start + offset) // tensor.element_size()
        copy = whole[first : first + int(tensor.numel())].reshape(tensor.shape)
        paddle.assign(tensor, copy)
        copy._share_buffer_to(tensor)
    return buffer
