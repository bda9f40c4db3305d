"""Which ranges the worker moves into 2 MiB pages: only whole 2 MiB pages inside runs of its tensors."""

import sys

from gpu_worker.huge_pages import HUGE_PAGE_BYTES, MAX_GAP_BYTES, aligned_runs, collapse

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
