"""A request as the scheduler sees it: its tokens, its progress and where it is in its life.

Which blocks it holds is the KV-cache manager's business (kv_cache_manager.py), not the request's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from service.contract.wire import RunningRequest, SamplingParams
from service.scheduler.fair_share import Tenant


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, at the front, to be recomputed
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(slots=True, eq=False)
class Request:
    """One generation request. `token_ids` is the prompt followed by every output token."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    owner: bytes = b""  # identity of the api replica that sent it: its deltas go there
    stop_token_ids: frozenset[int] = frozenset()  # a sampled one ends it (EOS unless ignored, and its own)
    max_num_tokens: int = 0  # prompt plus output never exceed this (max_tokens, max_model_len)
    priority: int = 0  # lower is served first (scheduling policy `priority`; always 0 under `fcfs`)
    tenant: Tenant | None = None  # whose request it is (fair_share.py)
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    max_computed_tokens: int = 0  # tokens computed before its latest preemption: computing them again is recomputation
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_skipped: int = 0  # admission rounds in which it was passed over at the head of the queue
    admitted_seq: int = -1  # order of the latest admission (lifo victim choice)
    queued_seq: int = -1  # order of its first time in the priority queue: equal keys go first come, first served
    sent_to_worker: bool = False  # the worker holds its state; next time send deltas only
    decode_message: RunningRequest | None = None  # "one more token, no new block": the same every such step
    num_output_placeholders: int = 0  # tokens that steps in flight will sample for it (overlapped loop)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
