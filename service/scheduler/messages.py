"""The wire messages a request gives rise to: its deltas for its api replica, and itself in full for the worker."""

from __future__ import annotations

from service.contract import wire
from service.scheduler.request import FinishReason, Request


def stop_token_ids(sampling: wire.SamplingParams, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
    """The tokens that end a request: its own stop ids, and EOS unless it ignores EOS."""
    return frozenset(sampling.stop_token_ids if sampling.ignore_eos else (*sampling.stop_token_ids, *eos_token_ids))


def token_delta(request: Request, token: wire.SampledToken, reason: FinishReason | None) -> wire.RequestDelta:
    """A token with its logprobs, or a request's last token."""
    return wire.RequestDelta(
        request_id=request.request_id,
        token_ids=[token.token_id],
        logprobs=None if token.logprob is None else [token.logprob],
        top_logprobs=None if token.top_logprobs is None else [token.top_logprobs],
        finish_reason=None if reason is None else reason.value,
        num_prompt_tokens=len(request.prompt_token_ids),
        num_cached_tokens=request.num_cached_tokens,
    )


def closing_delta(
    request: Request, reason: FinishReason, error: str | None, error_status: int = 500
) -> wire.RequestDelta:
    """The last delta of a request that ends without a new token."""
    return wire.RequestDelta(
        request_id=request.request_id,
        token_ids=[],
        finish_reason=reason.value,
        error=error,
        error_status=error_status if error else None,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
    )


def new_request_message(request: Request, block_ids: list[int], num_scheduled_tokens: int) -> wire.NewRequest:
    """A request in full, for a worker that holds no state for it (first time, or after preemption)."""
    return wire.NewRequest(
        request_id=request.request_id,
        token_ids=list(request.token_ids),
        num_prompt_tokens=request.num_prompt_tokens,
        sampling=request.sampling,
        block_ids=list(block_ids),
        num_computed_tokens=request.num_computed_tokens,
        num_scheduled_tokens=num_scheduled_tokens,
    )
