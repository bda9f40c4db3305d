"""Which ranges the worker moves into 2 MiB pages: only whole 2 MiB pages inside runs of its tensors."""

import ctypes
import errno
import sys

from worker.host import huge_pages
from worker.host.huge_pages import HUGE_PAGE_BYTES, MAX_GAP_BYTES, aligned_runs, collapse

MIB = 1 << 20


def test_a_tensor_gives_the_whole_2_mib_pages_inside_it():
    assert aligned_runs([(3 * MIB, 11 * MIB)]) == [(4 * MIB, 10 * MIB)]
    assert aligned_runs([(4 * MIB, 10 * MIB)]) == [(4 * MIB, 10 * MIB)]


def test_a_tensor_holding_no_whole_page_gives_nothing():
    assert aligned_runs([(3 * MIB, 5 * MIB)]) == []
    assert aligned_runs([]) == []


def test_tensors_separated_by_an_allocator_header_are_one_run():
    # Two 1.5 MiB tensors with 64 bytes between them fill the page [2, 4) MiB together.
    first = (2 * MIB - 64, 3 * MIB + MIB // 2)
    second = (first[1] + 64, first[1] + 64 + 3 * MIB // 2)
    assert aligned_runs([second, first]) == [(2 * MIB, 4 * MIB)]


def test_tensors_further_apart_than_a_header_are_not_joined_across_the_hole():
    first = (2 * MIB, 3 * MIB)
    second = (3 * MIB + MAX_GAP_BYTES + 64, 5 * MIB)
    # Joined, the page [2, 4) MiB would be moved and the hole between them made resident.
    assert aligned_runs([first, second]) == []


def test_every_range_is_page_aligned_and_inside_the_spans():
    spans = [(7 * MIB + 5, 19 * MIB + 3), (19 * MIB + 3 + 16, 23 * MIB), (40 * MIB, 49 * MIB - 1)]
    ranges = aligned_runs(spans)
    assert ranges == [(8 * MIB, 22 * MIB), (40 * MIB, 48 * MIB)]
    for start, end in ranges:
        assert start % HUGE_PAGE_BYTES == 0 and end % HUGE_PAGE_BYTES == 0


class Span:
    def __init__(self, start: int, size: int):
        self.start, self.size = start, size

    def data_ptr(self) -> int:
        return self.start

    def numel(self) -> int:
        return self.size

    def element_size(self) -> int:
        return 1


def test_off_linux_nothing_is_advised(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    moved = collapse([Span(4 * MIB, 8 * MIB)])  # an address nothing maps: advising it would fail
    assert (moved.tensor_bytes, moved.collapsed_bytes, moved.refused) == (8 * MIB, 0, "not Linux (darwin)")


class ScriptedMadvise:
    """madvise answering MADV_COLLAPSE with the errnos given, in turn, then 0; it records every call."""

    def __init__(self, collapse_errnos):
        self.collapse_errnos = list(collapse_errnos)
        self.calls = []

    def __call__(self, start, length, advice):
        self.calls.append((start, length, advice))
        if advice == huge_pages.MADV_COLLAPSE and self.collapse_errnos:
            ctypes.set_errno(self.collapse_errnos.pop(0))
            return -1
        return 0


def collapse_with(monkeypatch, madvise):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(huge_pages, "_madvise", lambda: madvise)
    return collapse([Span(4 * MIB, 8 * MIB)])


def test_a_collapse_the_kernel_calls_transient_is_asked_for_again(monkeypatch):
    madvise = ScriptedMadvise([errno.EAGAIN, errno.EAGAIN])
    moved = collapse_with(monkeypatch, madvise)
    assert (moved.collapsed_bytes, moved.refused) == (8 * MIB, "")
    assert [advice for _, _, advice in madvise.calls] == [huge_pages.MADV_HUGEPAGE] + [huge_pages.MADV_COLLAPSE] * 3
    assert {(start, length) for start, length, _ in madvise.calls} == {(4 * MIB, 8 * MIB)}


def test_a_collapse_refused_for_good_or_too_often_is_given_up_and_said(monkeypatch):
    madvise = ScriptedMadvise([errno.EINVAL])
    moved = collapse_with(monkeypatch, madvise)
    assert (moved.collapsed_bytes, moved.refused) == (0, "MADV_COLLAPSE: EINVAL (Invalid argument)")
    assert len(madvise.calls) == 2  # advised once, asked once

    madvise = ScriptedMadvise([errno.EAGAIN] * huge_pages.COLLAPSE_TRIES)
    moved = collapse_with(monkeypatch, madvise)
    assert moved.collapsed_bytes == 0 and moved.refused.startswith("MADV_COLLAPSE: EAGAIN")
    assert len(madvise.calls) == 1 + huge_pages.COLLAPSE_TRIES
