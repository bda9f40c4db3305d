"""Per-request worker state and the flat numpy inputs of one step built from it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.contract import wire

PENDING_TOKEN = -1  # an input token the step in flight has yet to sample


class StepError(ValueError):
    """A step that contradicts the worker's state (unknown request, too few blocks, ...)."""


@dataclass
class RequestState:
    """What the worker keeps for a request between steps."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: wire.SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    awaiting_token: bool = False  # a step in flight samples its next token (inputs built ahead leave it pending)
    # Its grammar's llguidance matcher, at its tokens so far (sample/grammar.py), or a PendingMatcher until the
    # request first samples, while the grammar's template builds; None: free.
    matcher: Any = None


@dataclass(frozen=True)
class StepInputs:
    """Flat inputs of one forward; request i's tokens are query_start[i]:query_start[i + 1]."""

    input_ids: np.ndarray  # [tokens]
    positions: np.ndarray  # [tokens]
    slot_mapping: np.ndarray  # [tokens] KV slot = block_id * block_size + position % block_size
    query_start: np.ndarray  # [requests + 1]
    context_lens: np.ndarray  # [requests] tokens in the cache after this step (kernel backends need it)
    block_table: np.ndarray  # [requests, max blocks], padded with block 0
    logits_indices: np.ndarray  # [samples] flat index of the last token of each sampling request
    sampling_requests: list[RequestState]
    # Built ahead, while the step before computes: (flat index, request, position) of each input
    # token that step samples; `fill_pending_tokens` puts them in once it has.
    pending_tokens: list[tuple[int, RequestState, int]]


def build_step_inputs(scheduled: list[tuple[RequestState, int]], block_size: int, num_blocks: int) -> StepInputs:
    """Inputs for computing `num_scheduled` tokens of each request after its computed ones."""
    if all(count == 1 for _, count in scheduled):
        return one_token_step_inputs([state for state, _ in scheduled], block_size, num_blocks)
    return any_step_inputs(scheduled, block_size, num_blocks)


def any_step_inputs(scheduled: list[tuple[RequestState, int]], block_size: int, num_blocks: int) -> StepInputs:
    """build_step_inputs for any numbers of tokens, in whole-array steps."""
    states = [state for state, _ in scheduled]
    query_lens = np.array([count for _, count in scheduled], dtype=np.int64)
    num_computed = np.array([state.num_computed_tokens for state in states], dtype=np.int64)
    num_tokens = np.array([len(state.token_ids) + state.awaiting_token for state in states], dtype=np.int64)
    context_lens = num_computed + query_lens
    query_start = np.concatenate([[0], np.cumsum(query_lens)])
    total = int(query_start[-1])

    block_table = _block_table(states)
    _check(states, context_lens, num_tokens, block_table, block_size, num_blocks)

    request_of_token = np.repeat(np.arange(len(states)), query_lens)
    positions = num_computed[request_of_token] + np.arange(total) - query_start[request_of_token]
    slots = block_table[request_of_token, positions // block_size] * block_size + positions % block_size
    input_ids = np.fromiter(
        itertools.chain.from_iterable(
            _known_then_pending(state.token_ids, start, end)
            for state, start, end in zip(states, num_computed, context_lens)
        ),
        dtype=np.int64,
        count=total,
    )
    pending = np.flatnonzero(input_ids == PENDING_TOKEN)
    samples = np.flatnonzero(context_lens == num_tokens)
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slots,
        query_start=query_start,
        context_lens=context_lens,
        block_table=block_table,
        logits_indices=query_start[samples + 1] - 1,
        sampling_requests=[states[i] for i in samples],
        pending_tokens=[(int(i), states[request_of_token[i]], int(positions[i])) for i in pending],
    )


def one_token_step_inputs(states: list[RequestState], block_size: int, num_blocks: int) -> StepInputs:
    """build_step_inputs where every request computes one token (a step of decodes, the usual step): the same
    inputs from per-request Python values, without most of the general path's ~20 whole-array operations, which
    cost more than the arrays' few entries (0.15-0.2 ms of a 4-6 ms one-sequence step, its caches cold). The
    checks are the general path's (_check)."""
    num_requests = len(states)
    positions = [state.num_computed_tokens for state in states]
    context_lens = np.array(positions, dtype=np.int64) + 1
    num_tokens = np.array([len(state.token_ids) + state.awaiting_token for state in states], dtype=np.int64)
    block_table = _block_table(states)
    _check(states, context_lens, num_tokens, block_table, block_size, num_blocks)
    input_ids, pending, sampled = [], [], []
    for row, (state, position) in enumerate(zip(states, positions)):
        if position < len(state.token_ids):
            input_ids.append(state.token_ids[position])
        else:
            input_ids.append(PENDING_TOKEN)
            pending.append((row, state, position))
        if position + 1 == len(state.token_ids) + state.awaiting_token:
            sampled.append(row)
    slots = [state.block_ids[p // block_size] * block_size + p % block_size for state, p in zip(states, positions)]
    return StepInputs(
        input_ids=np.array(input_ids, dtype=np.int64),
        positions=np.array(positions, dtype=np.int64),
        slot_mapping=np.array(slots, dtype=np.int64),
        query_start=np.arange(num_requests + 1, dtype=np.int64),
        context_lens=context_lens,
        block_table=block_table,
        logits_indices=np.array(sampled, dtype=np.int64),
        sampling_requests=[states[row] for row in sampled],
        pending_tokens=pending,
    )


def _known_then_pending(token_ids: list[int], start: int, end: int) -> list[int]:
    known = token_ids[start:end]
    return known if start + len(known) == end else known + [PENDING_TOKEN] * (end - start - len(known))


def fill_pending_tokens(inputs: StepInputs) -> list[RequestState]:
    """Put in the tokens the step before sampled (it has finished); return the requests it sampled
    none for (that step failed for them): they cannot be computed in this one."""
    lacking = []
    for index, state, position in inputs.pending_tokens:
        if position < len(state.token_ids):
            inputs.input_ids[index] = state.token_ids[position]
        elif state not in lacking:
            lacking.append(state)
    return lacking


def _block_table(states: list[RequestState]) -> np.ndarray:
    """[requests, most blocks]: each request's block ids, padded with block 0."""
    block_table = np.zeros((len(states), max(len(state.block_ids) for state in states)), dtype=np.int64)
    for row, state in enumerate(states):
        block_table[row, : len(state.block_ids)] = state.block_ids
    return block_table


def _check(states, context_lens, num_tokens, block_table, block_size, num_blocks) -> None:
    num_assigned = np.array([len(state.block_ids) for state in states])
    problems = {
        "schedules more tokens than it has": context_lens > num_tokens,
        "has too few blocks for its tokens": context_lens > num_assigned * block_size,
        "has a block id outside the cache": (block_table >= num_blocks).any(axis=1) | (block_table < 0).any(axis=1),
    }
    for problem, bad in problems.items():
        if bad.any():
            raise StepError(f"request {states[int(np.argmax(bad))].request_id} {problem}")
