"""POST /v1/completions: text in, text out, streamed or whole."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Depends, Request

from service.api.choice import ChoicePiece
from service.api.context import ApiContext, get_context
from service.api.errors import ApiError
from service.api.generation import ChoiceResult, Generation, choice_specs, unless_disconnected
from service.api.logprobs import completion_logprobs
from service.api.openapi import generation_responses
from service.api.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from service.api.served_model import ServedModel
from service.api.sse import sse_event, sse_response

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint

router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse, responses=generation_responses(CompletionResponse))
async def create_completion(body: CompletionRequest, request: Request, context: ApiContext = Depends(get_context)):
    model = context.served_model()
    model.check_name(body.model)
    model.check_token_ids(body.stop_token_ids or [], "stop_token_ids")
    model.check_token_ids(list(body.logit_bias_ids()), "logit_bias")
    if body.echo and body.logprobs is not None:
        raise ApiError(400, "echo together with logprobs is not supported.", param="echo")
    grammar = await context.grammars.for_request(body)
    prompts = await asyncio.to_thread(prompt_token_ids, model, body.prompt)  # off the event loop: it may be long
    max_tokens = body.max_tokens or DEFAULT_MAX_TOKENS
    budgets = [(prompt, model.check_fits(len(prompt), max_tokens)) for prompt in prompts]
    response_id = f"cmpl-{uuid.uuid4().hex}"
    specs = choice_specs(response_id, body, budgets, body.logprobs, context.tenant_of(request, body.user), grammar)
    generation = Generation(context.client, model, specs, body.stop_strings())
    echoes = [""] * len(specs)
    if body.echo:
        texts = await asyncio.to_thread(lambda: [model.decode(prompt) for prompt in prompts])
        echoes = [texts[spec.index // body.n] for spec in specs]
    num_prompt_tokens = sum(map(len, prompts))
    if body.stream:
        pieces = await generation.started(request)
        return sse_response(_chunks(body, model, response_id, pieces, echoes, num_prompt_tokens))
    results = await unless_disconnected(request, generation.collect())
    return CompletionResponse(
        id=response_id,
        model=model.name,
        choices=[_choice(model, body, result, echoes[result.index]) for result in results],
        usage=Usage.of(num_prompt_tokens, sum(result.num_output_tokens for result in results)),
    )


def prompt_token_ids(model: ServedModel, prompt: str | list[int] | list[str] | list[list[int]]) -> list[list[int]]:
    """The batch of prompts as token ids (one prompt is a batch of one)."""
    if isinstance(prompt, str):
        return [model.encode(prompt)]
    if not prompt:
        raise ApiError(400, "The prompt is empty.", param="prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    batch = []
    for item in prompt:
        if isinstance(item, str):
            batch.append(model.encode(item))
        else:
            model.check_token_ids(item, "prompt")
            batch.append(list(item))  # token ids are used exactly as given
    return batch


def _choice(model: ServedModel, body: CompletionRequest, result: ChoiceResult, echo: str) -> CompletionChoice:
    logprobs = completion_logprobs(model, result.logprobs, 0) if body.logprobs is not None else None
    return CompletionChoice(
        index=result.index, text=echo + result.text, logprobs=logprobs, finish_reason=result.finish_reason
    )


async def _chunks(
    body: CompletionRequest,
    model: ServedModel,
    response_id: str,
    pieces: AsyncIterator[ChoicePiece],
    echoes: list[str],
    num_prompt_tokens: int,
) -> AsyncIterator[str]:
    include_usage = body.include_usage()

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        response = CompletionResponse(id=response_id, model=model.name, choices=choices, usage=usage)
        return sse_event(response.model_dump_json(exclude=None if include_usage else {"usage"}))

    for index, echo in enumerate(echoes):
        if echo:
            yield chunk([CompletionChoice(index=index, text=echo)])
    num_output_tokens = [0] * len(echoes)
    text_offsets = [0] * len(echoes)
    async with aclosing(pieces):
        async for piece in pieces:
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(model, piece.logprobs, text_offsets[piece.index])
                text_offsets[piece.index] += sum(map(len, logprobs.tokens))
            num_output_tokens[piece.index] = piece.num_output_tokens
            choice = CompletionChoice(
                index=piece.index, text=piece.text, logprobs=logprobs, finish_reason=piece.finish_reason
            )
            yield chunk([choice])
    if include_usage:
        yield chunk([], Usage.of(num_prompt_tokens, sum(num_output_tokens)))
