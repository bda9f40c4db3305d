"""POST /v1/chat/completions: messages through the chat template, an assistant reply out."""

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
from service.api.logprobs import chat_logprobs
from service.api.openapi import generation_responses
from service.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from service.api.served_model import ServedModel
from service.api.sse import sse_event, sse_response
from service.api.tool_parser import CallDelta, ParsedCall, ToolCallParser, parse_reply

router = APIRouter()


@router.post(
    "/v1/chat/completions", response_model=ChatCompletionResponse, responses=generation_responses(ChatCompletionChunk)
)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, context: ApiContext = Depends(get_context)
):
    model = context.served_model()
    model.check_name(body.model)
    model.check_token_ids(body.stop_token_ids or [], "stop_token_ids")
    model.check_token_ids(list(body.logit_bias_ids()), "logit_bias")
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs to be true.", param="top_logprobs")
    body.calls_written_as(model.tool_format)
    grammar = await context.grammars.for_request(body)
    messages = [message.template_dict() for message in body.messages]
    tools = body.tool_dicts() if body.calls_tools() else None
    prompt = await asyncio.to_thread(model.encode_chat, messages, tools)  # off the event loop: it may be long
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = model.check_fits(len(prompt), requested)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    specs = choice_specs(
        response_id, body, [(prompt, max_tokens)], logprobs, context.tenant_of(request, body.user), grammar
    )
    generation = Generation(context.client, model, specs, body.stop_strings())
    if body.stream:
        pieces = await generation.started(request)
        return sse_response(_chunks(body, model, response_id, pieces, len(prompt)))
    results = await unless_disconnected(request, generation.collect())
    return ChatCompletionResponse(
        id=response_id,
        model=model.name,
        choices=[_choice(body, model, result) for result in results],
        usage=Usage.of(len(prompt), sum(result.num_output_tokens for result in results)),
    )


def _choice(body: ChatCompletionRequest, model: ServedModel, result: ChoiceResult) -> ChatChoice:
    """A whole choice: its text, or (with tools) its text outside the calls and the calls."""
    message, finish_reason = AssistantMessage(content=result.text), result.finish_reason
    if body.calls_tools():
        content, calls = parse_reply(result.text, model.tool_format, body.tool_names())
        if calls:
            message = AssistantMessage(content=content, tool_calls=[_tool_call(call) for call in calls])
            finish_reason = _calls_finish_reason(finish_reason)
    return ChatChoice(
        index=result.index,
        message=message,
        logprobs=chat_logprobs(model, result.logprobs) if body.logprobs else None,
        finish_reason=finish_reason,
    )


def _calls_finish_reason(finish_reason: str | None) -> str | None:
    """tool_calls where the model ended a reply with calls itself; a cut one (length) says so."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall(id=call.id, type="function", function=FunctionCall(name=call.name, arguments=call.arguments))


def _tool_call_delta(call: CallDelta) -> ToolCallDelta:
    function = FunctionCallDelta(name=call.name, arguments=call.arguments)
    if call.id is None:
        return ToolCallDelta(index=call.index, function=function)
    return ToolCallDelta(index=call.index, id=call.id, type="function", function=function)


async def _chunks(
    body: ChatCompletionRequest,
    model: ServedModel,
    response_id: str,
    pieces: AsyncIterator[ChoicePiece],
    num_prompt_tokens: int,
) -> AsyncIterator[str]:
    include_usage = body.include_usage()

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        response = ChatCompletionChunk(id=response_id, model=model.name, choices=choices, usage=usage)
        return sse_event(response.model_dump_json(exclude=None if include_usage else {"usage"}))

    for index in range(body.n):
        yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))])
    num_output_tokens = [0] * body.n
    parsers = None
    if body.calls_tools():
        parsers = [ToolCallParser(model.tool_format, body.tool_names()) for _ in range(body.n)]
    async with aclosing(pieces):
        async for piece in pieces:
            num_output_tokens[piece.index] = piece.num_output_tokens
            text, calls, finish_reason = piece.text, [], piece.finish_reason
            if parsers is not None:
                parser = parsers[piece.index]
                parsed = [parser.feed(text), *([parser.finish()] if finish_reason is not None else [])]
                text = "".join(delta.content for delta in parsed)
                calls = [_tool_call_delta(call) for delta in parsed for call in delta.calls]
                if parser.num_calls:
                    finish_reason = _calls_finish_reason(finish_reason)
            logprobs = chat_logprobs(model, piece.logprobs) if body.logprobs else None
            if not (text or calls or logprobs or finish_reason):
                continue  # all of it held back
            choice = ChatChunkChoice(
                index=piece.index,
                delta=ChatDelta(content=text or None, tool_calls=calls or None),
                logprobs=logprobs,
                finish_reason=finish_reason,
            )
            yield chunk([choice])
    if include_usage:
        yield chunk([], Usage.of(num_prompt_tokens, sum(num_output_tokens)))
