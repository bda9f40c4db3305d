"""The wire contract: every message between api, scheduler and worker.

Messages are msgspec structs in one tagged union, encoded as msgpack arrays (`array_like`:
the tag first, the fields in order, the protocol version last: no field names on the wire).
The many small structs of a step are `gc=False` (they hold no cycles), which keeps decoding
them off the garbage collector's books. Each carries the protocol version; `decode()`
rejects a malformed, unknown or wrong-version frame with `WireError`, which receivers count and
drop. Nothing is ever unpickled.

Scheduler -> worker traffic is deltas: a request is sent in full once (`NewRequest`), after
that only its newly added block ids and how many tokens to compute (`RunningRequest`).
Scheduler -> api traffic is one `DeltaBatch` per replica per step, not a frame per request, with
the step's plain tokens as two columns (request ids, token ids) rather than a struct each.
"""

from __future__ import annotations

from typing import Union

import msgspec

PROTOCOL_VERSION = 9
DEFAULT_TENANT = "default"  # whose a request is when nothing names a tenant


class WireError(ValueError):
    """A frame that is not a valid message of this protocol version."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick tokens and when to stop; shared by the api, scheduler and worker."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # None = no logprobs; k = chosen token's plus top-k
    logit_bias: dict[int, float] = {}  # token id -> added to its logit before sampling
    # An llguidance grammar the output must match (service/api/constraints.py builds it): None = unconstrained.
    grammar: str | None = None


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What an api replica needs to serve a model without its files."""

    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    tokenizer_json: str
    chat_template: str | None
    add_bos_token: bool = False
    aliases: list[str] = []  # other names requests may use (the GGUF file's own name)


class Message(msgspec.Struct, tag_field="type", kw_only=True, array_like=True):
    """Base of every frame: carries the protocol version (kw_only: encoded after the fields)."""

    version: int = PROTOCOL_VERSION


# ---------------------------------------------------------------- api <-> scheduler


class ApiHello(Message, tag="api_hello"):
    replica_id: str


class EngineReport(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """An engine's load, and what its prefix cache gained and lost since its last report, in order:
    `cache_event_hashes[i]` was cached if `cache_events_cached[i]`, else evicted. The api routes on it."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    steps_per_s: float  # steps completed in about the last second
    draining: bool = False
    cache_event_hashes: list[int] = []
    cache_events_cached: list[bool] = []


class ApiWelcome(Message, tag="api_welcome"):
    model: ModelInfo
    ready: bool
    block_size: int = 0  # of the prefix cache's blocks (service/contract/block_hashes.py hashes prompts alike)
    cached_block_hashes: list[int] = []  # the prefix cache now; reports carry its changes from here on


class GenerateRequest(Message, tag="generate"):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0  # lower is served first, under the scheduler's `priority` policy (fair: within a tenant)
    tenant: str = DEFAULT_TENANT  # whose request it is (the `fair` policy shares the engine among tenants)
    tenant_weight: float = 1.0  # the tenant's share relative to others'


class AbortRequest(Message, tag="abort"):
    request_id: str


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True, gc=False):
    token_id: int
    logprob: float


class RequestDelta(Message, tag="delta", gc=False):
    """New tokens of one request; the last delta has `finish_reason` set."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[TokenLogprob]] | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    error_status: int | None = None  # HTTP status the api should use for `error`
    refused: bool = False  # ended before it started (engine not ready, or draining): another engine may take it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


class DeltaBatch(Message, tag="deltas"):
    """Every delta one step produced for one api replica, in one frame.

    A step's plain tokens (no logprobs, not a request's last) travel as two columns:
    `token_request_ids[i]` got `token_ids[i]`. They come before `deltas`, which hold everything
    else (tokens with logprobs, a request's last token, ends without a token).
    """

    token_request_ids: list[str] = []
    token_ids: list[int] = []
    deltas: list[RequestDelta] = []
    report: EngineReport | None = None  # every replica gets one each step that changed the cache, else now and then

    def __post_init__(self) -> None:
        if len(self.token_request_ids) != len(self.token_ids):
            raise ValueError(f"{len(self.token_request_ids)} request ids for {len(self.token_ids)} tokens")

    def all_deltas(self) -> list[RequestDelta]:
        """The batch as one delta per entry, in the order they apply (columns first)."""
        plain = [RequestDelta(request_id=r, token_ids=[t]) for r, t in zip(self.token_request_ids, self.token_ids)]
        return plain + self.deltas


class StatusQuery(Message, tag="status_query"):
    request_ids: list[str] = []  # the replica's open requests, to learn which the scheduler lost


class SchedulerStatus(Message, tag="status"):
    ready: bool
    num_workers: int
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    unknown_request_ids: list[str] = []  # of the query's request ids, those this scheduler does not hold
    report: EngineReport | None = None  # its load (no cache events: those come with the deltas)


# ---------------------------------------------------------------- scheduler <-> worker


class WorkerHello(Message, tag="worker_hello"):
    worker_id: str
    num_kv_blocks: int
    block_size: int
    model: ModelInfo
    kernels: dict[str, str] = {}  # the kernels and CPU features the worker computes with (settings_info shows them)


class NewRequest(msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False):
    """A request the worker has no state for: all its tokens (prompt and any output so far)."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # already in the KV cache (prefix-cache hit)
    num_scheduled_tokens: int


class RunningRequest(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A request the worker already holds: only what changed."""

    request_id: str
    new_block_ids: list[int]
    num_scheduled_tokens: int


class SchedulerOutput(Message, tag="step"):
    """Everything the worker needs for one step; nothing else crosses."""

    step_id: int
    new_requests: list[NewRequest] = []
    running_requests: list[RunningRequest] = []
    finished_request_ids: list[str] = []  # done or aborted: drop state
    preempted_request_ids: list[str] = []  # blocks freed: drop state, it will come back as new
    reset: bool = False  # a new scheduler's first step: drop every request's state before this step

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.new_requests) + sum(
            r.num_scheduled_tokens for r in self.running_requests
        )

    @property
    def is_empty(self) -> bool:
        return not (self.new_requests or self.running_requests)


class SampledToken(msgspec.Struct, frozen=True, array_like=True, gc=False):
    request_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[TokenLogprob] | None = None


class StepResult(Message, tag="step_result"):
    """The worker's answer to one step: a token for every request that finished its tokens."""

    step_id: int
    sampled: list[SampledToken] = []  # in the order of the step's new_requests, then running_requests
    error: str | None = None
    compute_s: float = 0.0  # how long the worker computed the step (what the scheduler learns step costs from)
    refused: dict[str, str] = {}  # request id -> why the worker computes it not (its parameters): no token for it
    grammar_mask_s: float = 0.0  # of compute_s: filling and applying the grammar masks of constrained rows
    num_constrained: int = 0  # rows of the step sampled under a grammar


class Ping(Message, tag="ping"):
    pass


class Pong(Message, tag="pong"):
    pass


AnyMessage = Union[
    ApiHello,
    ApiWelcome,
    GenerateRequest,
    AbortRequest,
    RequestDelta,
    DeltaBatch,
    StatusQuery,
    SchedulerStatus,
    WorkerHello,
    SchedulerOutput,
    StepResult,
    Ping,
    Pong,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMessage)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(frame: bytes) -> AnyMessage:
    """Decode one frame; raise WireError for anything that is not a current message."""
    try:
        message = _decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"malformed frame: {exc}") from None
    if message.version != PROTOCOL_VERSION:
        raise WireError(f"protocol version {message.version}, expected {PROTOCOL_VERSION}")
    return message
