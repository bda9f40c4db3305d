"""A model-free worker with the real worker's step semantics, for tests and the simulator.

Its next token is a deterministic function of the whole prefix. With `verify_kv` it also
keeps a "KV cache" of token ids in slots and reads every context back through the block
table, so a block handed to the wrong request or a bad prefix-cache hit changes the output
(or raises) exactly as corrupted KV would in a real model.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.contract import wire

HASH_MULTIPLIER = 1_000_003
HASH_MODULUS = (1 << 61) - 1
EMPTY_SLOT = -1


def extend_prefix_hash(prefix_hash: int, token_ids: list[int]) -> int:
    for token_id in token_ids:
        prefix_hash = (prefix_hash * HASH_MULTIPLIER + token_id + 1) % HASH_MODULUS
    return prefix_hash


def next_token(prefix_hash: int, vocab_size: int) -> int:
    return (prefix_hash >> 7) % vocab_size


class KVCorruption(AssertionError):
    """The fake KV cache does not hold a request's own tokens where its block table says."""


@dataclass(slots=True)
class _FakeRequest:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    prefix_hash: int  # hash of token_ids[:num_computed_tokens]


class FakeWorker:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 50_000, verify_kv: bool = False):
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.verify_kv = verify_kv
        self.slots = [EMPTY_SLOT] * (num_blocks * block_size) if verify_kv else []
        self.requests: dict[str, _FakeRequest] = {}

    def execute(self, step: wire.SchedulerOutput) -> wire.StepResult:
        return self.compute(step.step_id, self.apply(step))

    def apply(self, step: wire.SchedulerOutput) -> list[tuple[str, int]]:
        """Take the step's deltas into the per-request state (the worker's input building);
        return (request id, tokens to compute) of each scheduled request."""
        if step.reset:
            self.requests.clear()
        for request_id in step.finished_request_ids + step.preempted_request_ids:
            self.requests.pop(request_id, None)
        work: list[tuple[str, int]] = []
        for new in step.new_requests:
            computed = new.token_ids[: new.num_computed_tokens]
            self.requests[new.request_id] = _FakeRequest(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens, extend_prefix_hash(0, computed)
            )
            work.append((new.request_id, new.num_scheduled_tokens))
        for running in step.running_requests:
            self.requests[running.request_id].block_ids.extend(running.new_block_ids)
            work.append((running.request_id, running.num_scheduled_tokens))
        return work

    def compute(self, step_id: int, work: list[tuple[str, int]]) -> wire.StepResult:
        """The fake model: compute the scheduled tokens and sample where a request reaches its end."""
        sampled = [token for request_id, num in work if (token := self._compute(request_id, num)) is not None]
        return wire.StepResult(step_id=step_id, sampled=sampled)

    def _compute(self, request_id: str, num_scheduled: int) -> wire.SampledToken | None:
        request = self.requests[request_id]
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_scheduled
        if end > len(request.token_ids) or end > len(request.block_ids) * self.block_size:
            raise KVCorruption(f"{request_id}: {end} tokens scheduled, {len(request.block_ids)} blocks held")
        if self.verify_kv:
            for position in range(start, end):
                self.slots[self._slot(request, position)] = request.token_ids[position]
            context = [self.slots[self._slot(request, position)] for position in range(end)]
            if context != request.token_ids[:end]:
                raise KVCorruption(f"{request_id}: context read through its block table differs from its tokens")
        request.prefix_hash = extend_prefix_hash(request.prefix_hash, request.token_ids[start:end])
        request.num_computed_tokens = end
        if end < len(request.token_ids):
            return None
        token_id = next_token(request.prefix_hash, self.vocab_size)
        request.token_ids.append(token_id)
        return wire.SampledToken(request_id, token_id)

    def _slot(self, request: _FakeRequest, position: int) -> int:
        return request.block_ids[position // self.block_size] * self.block_size + position % self.block_size
