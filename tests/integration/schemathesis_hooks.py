"""Schemathesis hooks for the conformance run (SCHEMATHESIS_HOOKS): keep each generation small.

On a CPU the real model makes a few tokens per second per sequence, so a generated request for
128 choices of the whole context would take minutes. Sizes the spec allows are capped here, to
values it allows too, so a request stays as valid or invalid as it was generated: choices and new
tokens in every request (one generated to break the schema elsewhere, say in a header, may still be
served), and the text and token ids of a valid request, so that it also fits the model's context (how
many tokens a text makes, no schema can say). An invalid request keeps its text: cutting it could cut
what makes it invalid. For the same reason a valid prompt text the model cannot spell at all (SmolLM2's
vocabulary has no token for some control bytes, such as \x06: the text makes no tokens, and the server
answers 400 "The prompt is empty", as transformers' tokenizer and vLLM would) gets one letter more.

Constraints likewise: whether a generated regex, grammar or JSON Schema can be enforced, no schema can say (the
server answers 400 naming the field, and the document lists that 400), nor does the document state that a request
names at most one constraint, and none with `ignore_eos`. A valid request keeps its first constraint field, with a
value of the same kind the server can enforce, and drops the others. Tools as well: each gets a name of its own and
parameters the server can enforce, a named tool_choice names the first of them, any tool_choice but none comes with
a tool (the server, like OpenAI and vLLM, refuses one without tools), and one that asks for calls comes without
another constraint.
"""

from __future__ import annotations

import functools
from pathlib import Path

import schemathesis

from service.api.protocol import MAX_CHOICES as ALLOWED_CHOICES
from service.contract.config import default_model_path
from worker.loading.gguf_checkpoint import GGUFCheckpoint

MAX_CHOICES = 2
MAX_NEW_TOKENS = 4
NEW_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")
# With these a request stays under the conformance run's context (1,024 tokens) even at 4 tokens a character.
MAX_ITEMS = 3  # messages, content parts, prompts of a batch
MAX_TEXT_CHARS = 24
MAX_PROMPT_TOKEN_IDS = 64


# The first constraint field a valid request names keeps its kind, with a value the server can enforce.
SERVABLE_CONSTRAINTS = {
    "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}},
    "structured_outputs": {"regex": "[ab]{1,3}"},
    "guided_json": {"type": "boolean"},
    "guided_regex": "[0-9]{1,2}",
    "guided_choice": ["yes", "no"],
    "guided_grammar": 'start: "x" | "y"',
}


def _one_servable_constraint(body: dict) -> None:
    named = [field for field in SERVABLE_CONSTRAINTS if body.get(field) is not None]
    text = body.get("response_format")
    if named == ["response_format"] and isinstance(text, dict) and text.get("type") == "text":
        return
    for index, field in enumerate(named):
        if index == 0:
            body[field] = SERVABLE_CONSTRAINTS[field]
            body["ignore_eos"] = False
        else:
            del body[field]


def _servable_tools(body: dict) -> None:
    tools = body.get("tools")
    if isinstance(tools, list):
        for index, tool in enumerate(tools):
            if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
                tool["function"]["name"] = f"f{index}"
                tool["function"]["parameters"] = {"type": "object"}
    choice = body.get("tool_choice")
    if choice is None or choice == "none":
        return
    if not isinstance(tools, list) or not tools:  # any other tool_choice needs tools, as with OpenAI and vLLM
        body["tools"] = [{"type": "function", "function": {"name": "f0"}}]
    if choice == "auto":  # calls are parsed and a begun call kept valid: another constraint may stay
        return
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        choice["function"]["name"] = "f0"
    for field in SERVABLE_CONSTRAINTS:
        body.pop(field, None)
    body["ignore_eos"] = False


@schemathesis.hook
def before_call(context, case, kwargs) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    if _is_count(body.get("n")) and MAX_CHOICES < body["n"] <= ALLOWED_CHOICES:
        body["n"] = MAX_CHOICES
    for field in NEW_TOKEN_FIELDS:
        if _is_count(body.get(field)) and body[field] > MAX_NEW_TOKENS:
            body[field] = MAX_NEW_TOKENS
    if all(body.get(field) is None for field in NEW_TOKEN_FIELDS):  # absent or null: the default
        body["max_tokens"] = MAX_NEW_TOKENS  # the defaults: 16 tokens, or a chat's whole remaining context
    if case.meta is not None and case.meta.generation.mode.is_negative:
        return
    _one_servable_constraint(body)
    _servable_tools(body)
    if "prompt" in body:
        body["prompt"] = _spelled(_shortened(body["prompt"]))
    if isinstance(body.get("messages"), list):
        body["messages"] = body["messages"][:MAX_ITEMS]
        for message in body["messages"]:
            if isinstance(message, dict) and "content" in message:
                message["content"] = _shortened(message["content"])


def _shortened(value: object) -> object:
    """A text, token-id list, batch or content-part list cut to the caps (never below one item or character)."""
    if isinstance(value, str):
        return value[:MAX_TEXT_CHARS]
    if isinstance(value, dict) and isinstance(value.get("text"), str):
        return {**value, "text": value["text"][:MAX_TEXT_CHARS]}
    if isinstance(value, list):
        if value and all(_is_count(item) for item in value):
            return value[:MAX_PROMPT_TOKEN_IDS]
        return [_shortened(item) for item in value[:MAX_ITEMS]]
    return value


@functools.cache
def _tokenizer():
    """The conformance run's model (the default one): its tokenizer, as the server builds it."""
    return GGUFCheckpoint(Path(default_model_path())).tokenizer.tokenizer


def _spelled(prompt: object) -> object:
    """A prompt text, or each text of a batch, that makes no token gets a letter that makes one."""
    if isinstance(prompt, list):
        return [_spelled(item) if isinstance(item, str) else item for item in prompt]
    if isinstance(prompt, str) and not _tokenizer().encode_batch([prompt], add_special_tokens=False)[0].ids:
        return prompt + "a"
    return prompt


def _is_count(value: object) -> bool:
    """A whole number, as JSON has it: 5 or 5.0 (the server takes both)."""
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, int) and not isinstance(value, bool)
