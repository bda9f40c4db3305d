"""What the forward takes (ModelInputs), and how a step's inputs reach the model, two ways behind one interface
(prepare while the step before computes, launch when the step starts, record what it sampled, release a
request's state):

- HostInputs: the flat arrays build_step_inputs makes on the host, made into tensors on the model's device as the
  attention asks for them (the CPU, and a GPU without the CUDA ops);
- DeviceInputs (inputs/device_inputs.py, a GPU with the CUDA ops): built on the device from a step's delta.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import paddle

from worker.inputs.step_inputs import RequestState, StepInputs


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
        right after a one-sequence step (attention/metadata.py's HostAttentionMetadata)."""
        return self.uploaded_ids if self.uploaded_ids is not None else paddle.to_tensor(self.host_ids)


class HostInputs:
    # The next step's inputs are built from the requests' host tokens: a token may change after its draw (the
    # constrained greedy rows that sample/grammar.py checks after).
    tokens_on_host = True

    def __init__(self, attention):
        self.attention = attention

    def prepare(self, inputs: StepInputs, scheduled: Sequence[tuple[RequestState, int]]) -> object:
        return self.attention.prepare(inputs)

    def launch(
        self, inputs: StepInputs, prepared: object, scheduled: Sequence[tuple[RequestState, int]]
    ) -> ModelInputs:
        return ModelInputs(prepared, host_ids=inputs.input_ids)

    def record(self, model_inputs: ModelInputs, tokens: paddle.Tensor) -> None:
        pass  # the host appends the tokens to the requests' state; the next inputs are built from that

    def release(self, request_id: str) -> None:
        pass

    def clear(self) -> None:
        pass
