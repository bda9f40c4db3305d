"""Render chat messages through a model's Jinja chat template, the way Hugging Face does.

The template comes from the scheduler, so it runs in Jinja's immutable sandbox with the
globals HF templates expect (`raise_exception`, `strftime_now`, a `tojson` that keeps
non-ASCII text).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

from jinja2 import Template, TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template rejected the messages, or is itself broken; `message_index` names the message if known."""

    def __init__(self, message: str, message_index: int | None = None) -> None:
        super().__init__(message)
        self.message_index = message_index


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None, **kwargs: object) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


@functools.lru_cache(maxsize=4)
def compile_template(source: str) -> Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from None


def render_chat(
    source: str,
    messages: list[dict[str, object]],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
) -> str:
    """The prompt text for `messages`, ending with the assistant's turn opener; `tools` for a template that renders
    them."""
    template = compile_template(source)

    def render(some_messages: list[dict[str, object]]) -> str:
        return template.render(
            messages=some_messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            tools=tools,
        )

    try:
        return render(messages)
    except Exception as exc:  # the template is data: any failure of it is a bad request, not a crash
        failure = exc
    # Only on failure: the shortest failing prefix of the conversation names the message at fault.
    for index in range(len(messages)):
        try:
            render(messages[: index + 1])
        except Exception as exc:
            role = messages[index].get("role")
            raise ChatTemplateError(
                f"the chat template failed on messages[{index}] (role {role!r}): {exc}", message_index=index
            ) from None
    raise ChatTemplateError(f"the chat template failed on these messages: {failure}") from None
