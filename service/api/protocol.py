"""OpenAI request and response bodies; these models are the API's documentation.

Requests are validated strictly (no "5" for 5, no true for 1, no NaN or infinities; 5.0 is 5, as
JSON has one number type and JSON Schema calls 5.0 an integer). A
parameter sent as JSON null means its default, as OpenAI's clients expect. Unknown parameters
are ignored. Numeric ranges are OpenAI's, and vLLM's for its extra parameters. Text must be
valid Unicode: a lone surrogate (`"\\ud800"` in JSON) is rejected before it reaches the tokenizer.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    WithJsonSchema,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from service.api.constraints import (
    ANY_JSON_OBJECT,
    Constraint,
    ConstraintError,
    canonical_json,
    choice_constraint,
    json_schema_constraint,
    only_one,
)
from service.api.tool_parser import ToolFormat
from service.api.tools import HERMES, tool_call_constraint
from service.contract import limits
from service.contract.limits import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS
from service.contract.wire import SamplingParams

MAX_CHOICES = 128
# Choice i samples with seed + i. Below 2**53, as JSON's number type (a double) holds every integer:
# a client or checker comparing as doubles draws the same line.
MAX_SEED = min(limits.MAX_SEED, 2**53 - 1) - MAX_CHOICES
NonEmptyText = Annotated[str, Field(min_length=1)]
# A token id; "x-token-id" marks it in the OpenAPI document, which bounds it by the served model's vocabulary.
TOKEN_ID_MARK = "x-token-id"
TokenId = Annotated[int, Field(ge=0, json_schema_extra={TOKEN_ID_MARK: True})]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
TOKEN_ID_TEXT = r"^(0|[1-9][0-9]{0,17})$"  # a decimal int64, no leading zeros
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=TOKEN_ID_TEXT)], Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
    WithJsonSchema(  # pydantic would write patternProperties, which lets any other key through
        {
            "type": "object",
            "propertyNames": {"type": "string", "pattern": TOKEN_ID_TEXT, TOKEN_ID_MARK: True},
            "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS},
        }
    ),
]


def whole_numbers(value: object) -> object:
    """`value` with each float that has no fraction as an int, in lists too: JSON has one number type, and JSON
    Schema calls 5.0 an integer. Strings, booleans and other floats stay as they came (and fail as ints)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [whole_numbers(item) for item in value]
    return value


class StrictRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def lone_surrogate_path(value: object, path: tuple[str | int, ...] = ()) -> tuple[str | int, ...] | None:
    """Where in a JSON value a string holds a lone surrogate (not valid Unicode), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
    elif isinstance(value, dict):
        for key, item in value.items():
            found = lone_surrogate_path(key, path) if isinstance(key, str) else None
            found = found if found is not None else lone_surrogate_path(item, (*path, key))
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = lone_surrogate_path(item, (*path, index))
            if found is not None:
                return found
    return None


class StreamOptions(StrictRequest):
    include_usage: bool = False


JsonSchemaValue = Annotated[dict[str, Any] | str, Field(description="A JSON Schema: an object, or its JSON text")]
ChoiceList = Annotated[list[str], Field(min_length=1)]


class ResponseFormatText(StrictRequest):
    type: Literal["text"]


class ResponseFormatJsonObject(StrictRequest):
    type: Literal["json_object"]


class JsonSchemaFormat(StrictRequest):
    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON Schema the reply follows")
    strict: bool | None = Field(None, description="Accepted; the schema is always enforced")


class ResponseFormatJsonSchema(StrictRequest):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema, Field(discriminator="type")
]


class StructuredOutputs(StrictRequest):
    """vLLM's structured_outputs: exactly one of these."""

    model_config = ConfigDict(populate_by_name=True)

    json_: JsonSchemaValue | None = Field(None, alias="json")
    regex: NonEmptyText | None = None
    choice: ChoiceList | None = None
    grammar: NonEmptyText | None = Field(None, description="A Lark grammar, or GBNF (llama.cpp's EBNF)")
    json_object: bool | None = None

    def constraint(self) -> Constraint | None:
        param = "structured_outputs"
        found = []
        if self.json_ is not None:
            found.append(json_schema_constraint(self.json_, f"{param}.json"))
        if self.regex is not None:
            found.append(Constraint("regex", f"{param}.regex", self.regex))
        if self.choice is not None:
            found.append(choice_constraint(self.choice, f"{param}.choice"))
        if self.grammar is not None:
            found.append(Constraint("grammar", f"{param}.grammar", self.grammar))
        if self.json_object:
            found.append(Constraint("json_object", f"{param}.json_object", canonical_json(ANY_JSON_OBJECT)))
        if not found:
            raise ConstraintError(f"'{param}' names no constraint: give one of json, regex, choice, grammar.", param)
        return only_one(found)


class GenerationRequest(StrictRequest):
    """The parameters /v1/completions and /v1/chat/completions share."""

    model: str | None = Field(None, description="Served model name (or an alias); empty = the one model served")
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="Independent choices to generate")
    temperature: float | None = Field(None, ge=0.0, le=limits.MAX_TEMPERATURE, description="0 = greedy; default 1")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=limits.MAX_TOP_K, description="0 or -1 = off")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    presence_penalty: float | None = Field(None, ge=-limits.MAX_PENALTY, le=limits.MAX_PENALTY)
    frequency_penalty: float | None = Field(None, ge=-limits.MAX_PENALTY, le=limits.MAX_PENALTY)
    repetition_penalty: float | None = Field(None, gt=0.0, le=limits.MAX_REPETITION_PENALTY)
    stop: NonEmptyText | list[NonEmptyText] | None = Field(None, description="Text that ends a choice; never returned")
    stop_token_ids: list[TokenId] | None = None
    logit_bias: LogitBias | None = Field(
        None, description="Token id (as text) -> a number in [-100, 100] added to its logit before sampling"
    )
    ignore_eos: bool = False
    priority: int = Field(
        0,
        ge=-limits.MAX_ABS_PRIORITY,
        le=limits.MAX_ABS_PRIORITY,
        description="Lower is served first when the server runs BLOCKSERVE_SCHEDULING_POLICY=priority (as vLLM), "
        "or within the request's tenant under `fair`",
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(
        None,
        max_length=limits.MAX_TENANT_CHARS,
        description="The end user (OpenAI's field); names the request's tenant when its API key does not",
    )
    response_format: ResponseFormat | None = Field(
        None, description="OpenAI's: text, json_object (any JSON object), or json_schema (a reply that follows it)"
    )
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's constraints on the output")
    guided_json: JsonSchemaValue | None = Field(None, description="vLLM's older name of structured_outputs.json")
    guided_regex: NonEmptyText | None = Field(None, description="vLLM's older name of structured_outputs.regex")
    guided_choice: ChoiceList | None = Field(None, description="vLLM's older name of structured_outputs.choice")
    guided_grammar: NonEmptyText | None = Field(None, description="vLLM's older name of structured_outputs.grammar")

    _shared_integers = field_validator("n", "top_k", "seed", "stop_token_ids", "priority", mode="before")(whole_numbers)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: object) -> object:
        # Checked on the raw body, so unknown parameters and chat-template fields are covered too.
        path = lone_surrogate_path(data)
        if path is not None:
            raise PydanticCustomError(
                "invalid_unicode",
                "The text is not valid Unicode (it holds a lone surrogate)",
                {"param": ".".join(map(str, path))},
            )
        return data

    def constraint(self) -> Constraint | None:
        """The one constraint on the output, if any; ConstraintError naming the fields if there are two."""
        return only_one(self.constraints())

    def constraints(self) -> list[Constraint]:
        """Every constraint the request's fields ask for."""
        found = []
        if isinstance(self.response_format, ResponseFormatJsonObject):
            found.append(Constraint("json_object", "response_format", canonical_json(ANY_JSON_OBJECT)))
        elif isinstance(self.response_format, ResponseFormatJsonSchema):
            schema = self.response_format.json_schema.schema_
            found.append(json_schema_constraint(schema, "response_format.json_schema.schema"))
        if self.structured_outputs is not None:
            found.append(self.structured_outputs.constraint())
        if self.guided_json is not None:
            found.append(json_schema_constraint(self.guided_json, "guided_json"))
        if self.guided_regex is not None:
            found.append(Constraint("regex", "guided_regex", self.guided_regex))
        if self.guided_choice is not None:
            found.append(choice_constraint(self.guided_choice, "guided_choice"))
        if self.guided_grammar is not None:
            found.append(Constraint("grammar", "guided_grammar", self.guided_grammar))
        return found

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(token_id): bias for token_id, bias in (self.logit_bias or {}).items()}

    def sampling_params(
        self, *, max_tokens: int, logprobs: int | None, choice: int, grammar: str | None = None
    ) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            min_p=self.min_p or 0.0,
            seed=None if self.seed is None else self.seed + choice,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            logit_bias=self.logit_bias_ids(),
            grammar=grammar,
        )


class CompletionRequest(GenerationRequest):
    """POST /v1/completions."""

    # The route refuses echo with logprobs (no prompt logprobs): the document says so too.
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [{"properties": {"echo": {"const": False}}}, {"properties": {"logprobs": {"type": "null"}}}]
        }
    )

    prompt: (
        NonEmptyText
        | TokenIds
        | Annotated[list[NonEmptyText], Field(min_length=1)]
        | Annotated[list[TokenIds], Field(min_length=1)]
    ) = Field(description="Text, token ids, or a batch of either; never empty")
    max_tokens: int | None = Field(None, ge=1, description="Default 16")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="Top alternatives per token")
    echo: bool = Field(False, description="Prepend the prompt to the text")

    _completion_integers = field_validator("prompt", "max_tokens", "logprobs", mode="before")(whole_numbers)


class TextPart(StrictRequest):
    type: Literal["text"]
    text: str


Content = str | list[TextPart]


class MessageParam(BaseModel):
    """One chat message; fields other than these reach the chat template untouched."""

    model_config = ConfigDict(strict=True, extra="allow")

    content: Content | None
    name: str | None = None

    def template_dict(self) -> dict[str, object]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content)
        message.setdefault("content", "")  # an assistant's tool calls alone: templates read content (as vLLM's)
        return message


class SystemMessageParam(MessageParam):
    role: Literal["system"]
    content: Content


class DeveloperMessageParam(MessageParam):
    role: Literal["developer"]
    content: Content


class UserMessageParam(MessageParam):
    role: Literal["user"]
    content: Content


class FunctionCall(StrictRequest):
    name: str
    arguments: str = Field(description="The arguments as a JSON text")


class ToolCall(StrictRequest):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessageParam(MessageParam):
    """An earlier reply: text, tool calls, or both."""

    # The document says so too (pydantic writes no schema for the validator below).
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
                {"required": ["tool_calls"], "properties": {"tool_calls": {"not": {"type": "null"}}}},
            ]
        }
    )
    role: Literal["assistant"]
    content: Content | None = None
    refusal: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _says_something(self) -> "AssistantMessageParam":
        if self.content is None and self.tool_calls is None:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolMessageParam(MessageParam):
    """A tool's answer to one tool call of the assistant."""

    role: Literal["tool"]
    content: Content
    tool_call_id: str


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
ChatMessage = Annotated[
    SystemMessageParam | DeveloperMessageParam | UserMessageParam | AssistantMessageParam | ToolMessageParam,
    Field(discriminator="role"),
]


class FunctionDefinition(StrictRequest):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON Schema of the arguments")
    strict: bool | None = Field(None, description="Accepted; a constrained call always follows parameters")


class ChatTool(StrictRequest):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictRequest):
    name: str


class NamedToolChoice(StrictRequest):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions."""

    # The route refuses top_logprobs without logprobs: the document says so too.
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"properties": {"top_logprobs": {"type": "null"}}},
                {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
            ]
        }
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, description="Default: what is left of the context")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Annotated[list[ChatTool], Field(min_length=1)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="auto (with tools; the default): the reply's calls are parsed, and a begun call is kept valid by "
        "grammar; required, or a named function: the reply is calls, by grammar; none: no calls",
    )
    parallel_tool_calls: bool | None = Field(
        None, description="Whether a reply may hold several calls (false: the grammar allows one)"
    )

    _chat_integers = field_validator("max_tokens", "max_completion_tokens", "top_logprobs", mode="before")(
        whole_numbers
    )
    _tool_format: ToolFormat = PrivateAttr(HERMES)  # the served model's, set by the route

    def calls_written_as(self, tool_format: ToolFormat) -> None:
        """The format of the served model's tool calls, which the grammar of its calls writes."""
        self._tool_format = tool_format

    def tool_dicts(self) -> list[dict]:
        return [tool.model_dump(exclude_none=True, by_alias=True) for tool in self.tools or []]

    def tool_names(self) -> set[str]:
        return {tool.function.name for tool in self.tools or []}

    def calls_tools(self) -> bool:
        """Whether the reply is parsed for tool calls: tools given, and tool_choice not none."""
        return bool(self.tools) and self.tool_choice != "none"

    def constraints(self) -> list[Constraint]:
        """The generation's constraints, and the grammar of the calls tool_choice allows. With "auto" that grammar
        only keeps a begun call valid; another constraint, or ignore_eos, leaves it out (the reply is still parsed)."""
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ConstraintError("tool_choice needs tools.", "tool_choice")
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) < len(names):
            raise ConstraintError("Each function of tools needs a name of its own.", "tools")
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        others = super().constraints()
        if choice in (None, "auto") and (others or self.ignore_eos):
            return others
        calls = tool_call_constraint(
            self.tool_dicts(), choice, self.parallel_tool_calls is not False, self._tool_format
        )
        return [*others, *([calls] if calls is not None else [])]


# ---------------------------------------------------------------- responses


def now_s() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        total_tokens = prompt_tokens + completion_tokens
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=total_tokens)


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """A whole completion, and also the shape of each streamed chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class OmitsNone(BaseModel):
    """A delta carries only what changed: fields that are None are left out."""

    @model_serializer(mode="wrap")
    def _omit_empty(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class FunctionCallDelta(OmitsNone):
    name: str | None = Field(None, description="In a call's first delta")
    arguments: str | None = Field(None, description="The next piece of the arguments' JSON text")


class ToolCallDelta(OmitsNone):
    """Part of a tool call in a streamed delta: the first has its id, type and name, the rest pieces of its
    arguments (OpenAI's clients join them by `index`)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(OmitsNone):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error answer, OpenAI's shape."""

    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    ready: bool
    reason: str | None = None
    num_workers: int | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "blockserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
