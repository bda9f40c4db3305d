"""How a step's inputs reach the model, two ways behind one interface (prepare while the step before
computes, launch when the step starts, record what it sampled, release a request's state):

- HostInputs: the flat arrays build_step_inputs makes on the host are copied to the model's device
  (the CPU, and a GPU without the CUDA ops);
- DeviceInputs (a GPU with the CUDA ops): the running requests' block tables stay on the device, one
  row per batch slot; each step sends its compact delta (worker/inputs/step_delta.py) and the CUDA op
  bs_prepare_step_inputs builds the inputs there, taking a decode's token from the slot's entry of
  `last_sampled`, which the sampling of the step before wrote without a round trip through the host.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import paddle

from worker.attention.custom_kernels import CustomAttentionMetadata
from worker.inputs.step_delta import BatchSlots, ScheduledRequest, StepDelta, pack_step_delta
from worker.inputs.step_inputs import RequestState, StepError, StepInputs
from worker.sample.sampler import Draw


@dataclass(frozen=True)
class ModelInputs:
    """What the forward takes, on the model's device: the step's token ids and its attention metadata."""

    attention_metadata: object
    uploaded_ids: paddle.Tensor | None = None  # int64 [tokens] on the device; None: made from host_ids if asked
    host_ids: np.ndarray | None = None
    sampled_slots: paddle.Tensor | None = None  # DeviceInputs: the batch slot of each sampling row

    @functools.cached_property
    def input_ids(self) -> paddle.Tensor:
        """int64 [tokens] on the model's device. From the host it is made only where the forward asks for it: the
        fused decoder stack reads the ids in the step's layout instead, and a tensor from numpy costs 60-140 us
        right after a one-sequence step (custom_attention.HostAttentionMetadata)."""
        return self.uploaded_ids if self.uploaded_ids is not None else paddle.to_tensor(self.host_ids)


class HostInputs:
    def __init__(self, attention):
        self.attention = attention

    def prepare(self, inputs: StepInputs, scheduled: Sequence[tuple[RequestState, int]]) -> object:
        return self.attention.prepare(inputs)

    def launch(
        self, inputs: StepInputs, prepared: object, scheduled: Sequence[tuple[RequestState, int]]
    ) -> ModelInputs:
        return ModelInputs(prepared, host_ids=inputs.input_ids)

    def record(self, model_inputs: ModelInputs, draw: Draw) -> None:
        pass  # the host appends the tokens to the requests' state; the next inputs are built from that

    def release(self, request_id: str) -> None:
        pass

    def clear(self) -> None:
        pass


class DeviceInputs:
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

    def record(self, model_inputs: ModelInputs, draw: Draw) -> None:
        """Each sampling row's token into its slot's last_sampled: the next step's decode input."""
        if model_inputs.sampled_slots is not None:
            paddle.scatter_(self.last_sampled, model_inputs.sampled_slots, draw.tokens, overwrite=True)

    def release(self, request_id: str) -> None:
        self.slots.release(request_id)

    def clear(self) -> None:
        self.slots.clear()
