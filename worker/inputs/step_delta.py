"""A step as a compact delta for the device step-input kernels (custom_ops/gpu/step_input_kernels.cuh).

On a GPU the running requests' block tables stay on the device, one row per batch slot. Each step
the host sends one int64 array: a record per scheduled request (StepRecord, the kernels' field
order), the block ids appended since the device last saw the request, and the tokens the host
knows; a token the step before samples (still pending here) is read on the device from that
step's `last_sampled` entry of the slot. The kernels turn it into the flat inputs that
step_inputs.build_step_inputs makes on the host. NumPy only: the GPU harness imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np


class StepRecord(IntEnum):
    """Fields of one request's record, in the order of the kernels' StepRecordField."""

    SLOT = 0
    NUM_COMPUTED = 1
    NUM_SCHEDULED = 2
    QUERY_START = 3
    NUM_BLOCKS_BEFORE = 4
    NUM_NEW_BLOCKS = 5
    NEW_BLOCKS_OFFSET = 6
    NUM_KNOWN_TOKENS = 7
    KNOWN_TOKENS_OFFSET = 8


class SlotsExhausted(RuntimeError):
    """More requests at once than the device has batch slots (BLOCKSERVE_MAX_NUM_SEQS)."""


@dataclass(frozen=True)
class ScheduledRequest:
    """What the delta says of one scheduled request."""

    slot: int
    num_computed: int  # tokens already in the cache
    num_scheduled: int  # tokens this step computes
    num_blocks_before: int  # blocks of its table row the device already holds
    new_block_ids: Sequence[int]  # appended after those
    known_tokens: Sequence[int]  # the first len(known_tokens) of the step's tokens; the rest is last_sampled[slot]


@dataclass(frozen=True)
class StepDelta:
    packed: np.ndarray  # int64 [records | new block ids | known tokens]
    num_requests: int
    num_tokens: int
    table_width: int  # columns of the step's block table: its widest row


def pack_step_delta(requests: Sequence[ScheduledRequest]) -> StepDelta:
    """The one array the host sends for `requests` (each with at least one scheduled token)."""
    num_fields = len(StepRecord)
    records = np.zeros((len(requests), num_fields), dtype=np.int64)
    scheduled = np.array([r.num_scheduled for r in requests], dtype=np.int64)
    new_counts = np.array([len(r.new_block_ids) for r in requests], dtype=np.int64)
    known_counts = np.array([len(r.known_tokens) for r in requests], dtype=np.int64)
    records[:, StepRecord.SLOT] = [r.slot for r in requests]
    records[:, StepRecord.NUM_COMPUTED] = [r.num_computed for r in requests]
    records[:, StepRecord.NUM_SCHEDULED] = scheduled
    records[:, StepRecord.QUERY_START] = np.cumsum(scheduled) - scheduled
    records[:, StepRecord.NUM_BLOCKS_BEFORE] = [r.num_blocks_before for r in requests]
    records[:, StepRecord.NUM_NEW_BLOCKS] = new_counts
    records[:, StepRecord.NEW_BLOCKS_OFFSET] = records.size + np.cumsum(new_counts) - new_counts
    records[:, StepRecord.NUM_KNOWN_TOKENS] = known_counts
    records[:, StepRecord.KNOWN_TOKENS_OFFSET] = (
        records.size + new_counts.sum() + np.cumsum(known_counts) - known_counts
    )
    packed = np.concatenate(
        [
            records.reshape(-1),
            np.fromiter((b for r in requests for b in r.new_block_ids), dtype=np.int64, count=int(new_counts.sum())),
            np.fromiter((t for r in requests for t in r.known_tokens), dtype=np.int64, count=int(known_counts.sum())),
        ]
    )
    width = max(r.num_blocks_before + len(r.new_block_ids) for r in requests)
    return StepDelta(packed, len(requests), int(scheduled.sum()), width)


class BatchSlots:
    """Which device batch slot each running request holds, and how many of its blocks the device has.

    A request takes a slot when first scheduled and gives it back when it finishes or is preempted.
    Block counts move only when a step is launched (`commit`): a step prepared twice sends the same delta.
    """

    def __init__(self, num_slots: int, max_blocks_per_slot: int):
        self.max_blocks_per_slot = max_blocks_per_slot
        self._free = list(range(num_slots - 1, -1, -1))
        self._slots: dict[str, int] = {}
        self._blocks_on_device: dict[str, int] = {}

    def slot_of(self, request_id: str) -> int:
        if request_id not in self._slots:
            if not self._free:
                raise SlotsExhausted(f"no free batch slot for request {request_id}")
            self._slots[request_id] = self._free.pop()
            self._blocks_on_device[request_id] = 0
        return self._slots[request_id]

    def blocks_on_device(self, request_id: str) -> int:
        return self._blocks_on_device.get(request_id, 0)

    def commit(self, request_id: str, num_blocks: int) -> None:
        self._blocks_on_device[request_id] = num_blocks

    def release(self, request_id: str) -> None:
        if (slot := self._slots.pop(request_id, None)) is not None:
            self._free.append(slot)
            self._blocks_on_device.pop(request_id, None)

    def clear(self) -> None:
        for request_id in list(self._slots):
            self.release(request_id)
