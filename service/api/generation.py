"""Run the choices of one HTTP request as scheduler requests, side by side.

Each choice is its own scheduler request with its own id. Their pieces are merged into one
stream in arrival order. Leaving the stream early (a client that went away) cancels every
choice, which aborts its scheduler request; that cleanup never awaits, so it also runs inside
a cancelled task. A streamed response starts only once the first piece has come, so a generation
that fails before its first token (no worker, a request the worker refuses) gets the same HTTP
status as a response that is not streamed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TypeVar

from starlette.requests import Request

from service.api.choice import ChoicePiece, ChoiceState, SampledLogprobs
from service.api.errors import ApiError
from service.api.protocol import GenerationRequest
from service.api.scheduler_client import SchedulerClient
from service.api.served_model import ServedModel
from service.contract.wire import DEFAULT_TENANT, SamplingParams

T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer
RETRY_AFTER_S = 1  # what a 429 (a tenant at its most queued requests) asks the client to wait


@dataclass(frozen=True)
class ChoiceSpec:
    index: int
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    tenant: tuple[str, float] = (DEFAULT_TENANT, 1.0)  # whose request it is, and the tenant's weight


@dataclass
class ChoiceResult:
    """A whole choice, for a response that is not streamed."""

    index: int
    text: str = ""
    logprobs: list[SampledLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: int = 0


def choice_specs(
    request_id: str,
    body: GenerationRequest,
    prompts: list[tuple[list[int], int]],
    logprobs: int | None,
    tenant: tuple[str, float] = (DEFAULT_TENANT, 1.0),
    grammar: str | None = None,
) -> list[ChoiceSpec]:
    """`body.n` choices for each (prompt token ids, max_tokens), each constrained by `grammar` if given; indexes run
    prompt by prompt."""
    specs = []
    for prompt_index, (prompt_token_ids, max_tokens) in enumerate(prompts):
        for choice in range(body.n):
            index = prompt_index * body.n + choice
            sampling = body.sampling_params(max_tokens=max_tokens, logprobs=logprobs, choice=choice, grammar=grammar)
            specs.append(ChoiceSpec(index, f"{request_id}-{index}", prompt_token_ids, sampling, body.priority, tenant))
    return specs


class Generation:
    """The choices of one HTTP request."""

    def __init__(self, client: SchedulerClient, model: ServedModel, specs: list[ChoiceSpec], stop: list[str]) -> None:
        self._client = client
        self._model = model
        self._specs = specs
        self._stop = stop

    async def stream(self) -> AsyncIterator[ChoicePiece]:
        """Pieces of all choices as they come; raises ApiError when one fails."""
        pieces: asyncio.Queue[ChoicePiece | BaseException | None] = asyncio.Queue()
        tasks = [asyncio.create_task(self._run_choice(spec, pieces)) for spec in self._specs]
        try:
            running = len(tasks)
            while running:
                item = await pieces.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    async def started(self, request: Request) -> AsyncIterator[ChoicePiece]:
        """The pieces of all choices once the first has come; raises the ApiError of a generation that
        fails before it (499 if the client leaves first). The caller closes the iterator."""
        pieces = self.stream()
        try:
            first = await unless_disconnected(request, anext(pieces))
        except BaseException:
            await pieces.aclose()
            raise
        return _after(first, pieces)

    async def collect(self) -> list[ChoiceResult]:
        results = {spec.index: ChoiceResult(spec.index) for spec in self._specs}
        async with aclosing(self.stream()) as pieces:
            async for piece in pieces:
                result = results[piece.index]
                result.text += piece.text
                result.logprobs += piece.logprobs
                result.finish_reason = piece.finish_reason
                result.num_output_tokens = piece.num_output_tokens
        return [results[index] for index in sorted(results)]

    async def _run_choice(self, spec: ChoiceSpec, pieces: asyncio.Queue) -> None:
        state = ChoiceState(spec.index, self._model.tokenizer, spec.prompt_token_ids, self._stop)
        try:
            deltas = self._client.generate(
                spec.request_id, spec.prompt_token_ids, spec.sampling, spec.priority, *spec.tenant
            )
            async with aclosing(deltas):
                async for delta in deltas:
                    if delta.error is not None or delta.finish_reason == "error":
                        status = delta.error_status or 500
                        retry = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None  # a tenant's limit
                        raise ApiError(status, delta.error or "The generation failed.", headers=retry)
                    piece = state.add(delta)
                    if piece is not None:
                        pieces.put_nowait(piece)
                        if piece.finish_reason is not None:
                            break  # a stop string: leaving the stream aborts the request
        except Exception as exc:  # handed to the reader, which decides what the client sees
            pieces.put_nowait(exc)
        finally:
            pieces.put_nowait(None)


async def _after(first: ChoicePiece, rest: AsyncIterator[ChoicePiece]) -> AsyncIterator[ChoicePiece]:
    try:
        yield first
        async for piece in rest:
            yield piece
    finally:
        await rest.aclose()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """The result of `work`, or a 499 ApiError (after cancelling it) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # `work` may be a step of a generator the caller closes next: it must have stopped running by then.
            await asyncio.wait({task})
    if task not in done:
        raise ApiError(CLIENT_CLOSED_REQUEST, "The client closed the connection.")
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
