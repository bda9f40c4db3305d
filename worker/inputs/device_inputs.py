"""A step's inputs built on the GPU (with the CUDA ops): the running requests' block tables stay on the device, one
row per batch slot; each step sends its compact delta (inputs/step_delta.py) and the CUDA op
bs_prepare_step_inputs builds the inputs there, taking a decode's token from the slot's entry of `last_sampled`,
which the sampling of the step before wrote without a round trip through the host."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import paddle

from worker.attention.metadata import CustomAttentionMetadata
from worker.inputs.model_inputs import ModelInputs
from worker.inputs.step_delta import BatchSlots, ScheduledRequest, StepDelta, pack_step_delta
from worker.inputs.step_inputs import RequestState, StepError, StepInputs


class DeviceInputs:
    tokens_on_host = False  # the next step's decode inputs are the drawn tokens where they are, on the device

    def __init__(self, ops: ModuleType, block_size: int, num_slots: int, max_blocks_per_slot: int):
        self.ops = ops
        self.block_size = block_size
        self.slots = BatchSlots(num_slots, max_blocks_per_slot)
        self.block_tables = paddle.zeros([num_slots, max_blocks_per_slot], dtype="int64")
        self.last_sampled = paddle.zeros([num_slots], dtype="int64")

    def prepare(self, inputs: StepInputs, scheduled: Sequence[tuple[RequestState, int]]) -> StepDelta:
        """The step's delta, on the host: each request's new blocks and the tokens the host knows."""
        requests = []
        for state, count in scheduled:
            first = state.num_computed_tokens
            known = state.token_ids[first : first + count]
            if count - len(known) > 1 or len(state.block_ids) > self.slots.max_blocks_per_slot:
                raise StepError(f"request {state.request_id} does not fit the device's step inputs")
            slot = self.slots.slot_of(state.request_id)
            before = self.slots.blocks_on_device(state.request_id)
            requests.append(ScheduledRequest(slot, first, count, before, state.block_ids[before:], known))
        return pack_step_delta(requests)

    def launch(
        self, inputs: StepInputs, delta: StepDelta, scheduled: Sequence[tuple[RequestState, int]]
    ) -> ModelInputs:
        """Uploads the delta and queues the op that builds the inputs from it."""
        outputs = self.ops.bs_prepare_step_inputs(
            paddle.to_tensor(delta.packed),
            self.block_tables,
            self.last_sampled,
            delta.num_requests,
            delta.num_tokens,
            delta.table_width,
            self.block_size,
        )
        input_ids, positions, slot_mapping, query_start, context_lens, block_table = outputs[:6]
        for state, _ in scheduled:
            self.slots.commit(state.request_id, len(state.block_ids))
        sampled_slots = [self.slots.slot_of(state.request_id) for state in inputs.sampling_requests]
        return ModelInputs(
            CustomAttentionMetadata(positions, slot_mapping, query_start, context_lens, block_table),
            uploaded_ids=input_ids,
            sampled_slots=paddle.to_tensor(sampled_slots, dtype="int64") if sampled_slots else None,
        )

    def record(self, model_inputs: ModelInputs, tokens: paddle.Tensor) -> None:
        """Each sampling row's token (`tokens`, on the device) into its slot's last_sampled: the next step's decode
        input."""
        if model_inputs.sampled_slots is not None:
            paddle.scatter_(self.last_sampled, model_inputs.sampled_slots, tokens, overwrite=True)

    def release(self, request_id: str) -> None:
        self.slots.release(request_id)

    def clear(self) -> None:
        self.slots.clear()
