"""Tool calls in Hermes' format, which SmolLM2 and Qwen are prompted or trained with: the model writes each call as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

A chat template that does not render `tools` (SmolLM2's) gets them as a system preamble that asks for that format.
`tool_choice` "required" or naming a function constrains the reply with a grammar of such calls (one call unless
`parallel_tool_calls`); "auto" only parses the reply; "none" neither. Parsers are kept by format in `PARSERS`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from service.api.constraints import JSON_LAYOUT, Constraint, ConstraintError, canonical_json

HERMES_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
PREAMBLE = (
    "You are a function calling AI model. You may call one or more functions to assist with the user query. "
    "Here are the available tools:\n<tools>\n{tools}\n</tools>\n"
    "For each function call, return a JSON object with the function name and arguments within <tool_call></tool_call> "
    'tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def with_tool_preamble(messages: list[dict[str, object]], tools: list[dict]) -> list[dict[str, object]]:
    """The messages with the tools described in the system message (a new one first, or the first one's text after
    the preamble)."""
    described = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    preamble = PREAMBLE.format(tools=described)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{preamble}\n\n{messages[0].get('content', '')}"}, *messages[1:]]
    return [{"role": "system", "content": preamble}, *messages]


def tool_call_constraint(tools: list[dict], tool_choice: object, parallel: bool) -> Constraint | None:
    """The grammar `tool_choice` asks for: calls of any tool ("required") or of the one named; None otherwise."""
    if tool_choice in (None, "auto", "none"):
        return None
    functions = [tool["function"] for tool in tools]
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        functions = [function for function in functions if function["name"] == name]
        if not functions:
            raise ConstraintError(f"tool_choice names the function '{name}', which is not in tools.", "tool_choice")
    bodies = [
        {
            "type": "object",
            "properties": {
                "name": {"const": function["name"]},
                "arguments": function.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for function in functions
    ]
    schema = {"anyOf": bodies} if len(bodies) > 1 else bodies[0]
    body = canonical_json({**schema, "x-guidance": JSON_LAYOUT})
    calls = 'call ("\\n" call)*' if parallel else "call"
    lark = f'start: {calls}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json {body}\n'
    return Constraint("tools", "tool_choice" if isinstance(tool_choice, dict) else "tools", lark)


def parse_hermes(text: str, tool_names: set[str]) -> tuple[str | None, list[ParsedCall]]:
    """The reply's text outside its calls (None if nothing is left) and its calls of known tools, in order. A call
    that is not JSON, or names no tool, stays in the text."""
    calls, kept, end = [], [], 0
    for match in HERMES_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or call.get("name") not in tool_names:
            continue
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append(
            ParsedCall(f"call_{uuid.uuid4().hex[:24]}", call["name"], json.dumps(arguments, ensure_ascii=False))
        )
        kept.append(text[end : match.start()])
        end = match.end()
    kept.append(text[end:])
    content = "".join(kept).strip()
    return (content or None), calls


PARSERS = {"hermes": parse_hermes}  # by the format a model family writes calls in


class ToolCallStream:
    """One streamed choice's text with its tool calls held back: text streams until a `<tool_call>` may begin; from
    there on it is held, and at the end parsed into calls and the text outside them."""

    OPEN = "<tool_call>"

    def __init__(self, tool_names: set[str]) -> None:
        self._tool_names = tool_names
        self._held = ""
        self._calling = False

    def feed(self, text: str) -> str:
        """The part of `text` (with what was held) that can stream now."""
        self._held += text
        if self._calling:
            return ""
        start = self._held.find(self.OPEN)
        if start >= 0:
            self._calling = True
            out, self._held = self._held[:start], self._held[start:]
            return out
        keep = next((n for n in range(len(self.OPEN) - 1, 0, -1) if self._held.endswith(self.OPEN[:n])), 0)
        out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        return out

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """What was held: its text outside the calls, and the calls."""
        content, calls = parse_hermes(self._held, self._tool_names) if self._calling else (self._held, [])
        if not calls:
            return self._held, []
        return content or "", calls
