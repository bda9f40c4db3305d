"""Tool calls in the format the model's family writes them, `FORMATS` by BLOCKSERVE_TOOL_CALL_PARSER's names:

- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, anywhere in the reply (SmolLM2, Qwen,
  Hermes; the format of the preamble below for a template that does not render tools);
- llama3_json: `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several separated by `;`,
  as the whole reply (Llama 3.1 and 3.2).

`auto` picks by the chat template: a family's template shows the markup of its calls (`FAMILY_MARKERS`).
`tool_choice` "required" or naming a function constrains the reply with a grammar of calls in the format (one call
unless `parallel_tool_calls`); "auto" only parses the reply (service/api/tool_parser.py); "none" neither.
"""

from __future__ import annotations

import json
import re

from service.api.constraints import JSON_LAYOUT, Constraint, ConstraintError, canonical_json
from service.api.tool_parser import ToolFormat

HERMES = ToolFormat(
    name="hermes",
    open="<tool_call>",
    close="</tool_call>",
    separator="\n",
    arguments_keys=("arguments", "parameters"),
    calls_follow_text=True,
    preamble=(
        "You are a function calling AI model. You may call one or more functions to assist with the user query. "
        "Here are the available tools:\n<tools>\n{tools}\n</tools>\n"
        "For each function call, return a JSON object with the function name and arguments within "
        '<tool_call></tool_call> tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
        "</tool_call>"
    ),
)
LLAMA3_JSON = ToolFormat(
    name="llama3_json",
    open="<|python_tag|>",
    close="",
    separator="; ",
    arguments_keys=("parameters", "arguments"),
    calls_follow_text=False,
    preamble=(
        "Given the following functions, please respond with a JSON for a function call with its proper arguments "
        "that best answers the given prompt.\n\n"
        'Respond in the format {{"name": function name, "parameters": dictionary of argument name and its value}}. '
        "Do not use variables.\n\n{tools}"
    ),
)
FORMATS = {tool_format.name: tool_format for tool_format in (HERMES, LLAMA3_JSON)}
# Markup a family's chat template shows, first found wins; a template without either gets Hermes' preamble.
FAMILY_MARKERS = (("<tool_call>", HERMES), ("<|python_tag|>", LLAMA3_JSON))


def format_for(parser: str, chat_template: str | None) -> ToolFormat:
    """The format of BLOCKSERVE_TOOL_CALL_PARSER's `parser`; for "auto", the one the chat template's family writes."""
    if parser != "auto":
        return FORMATS[parser]
    return next((found for marker, found in FAMILY_MARKERS if marker in (chat_template or "")), HERMES)


def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def with_tool_preamble(
    messages: list[dict[str, object]], tools: list[dict], tool_format: ToolFormat
) -> list[dict[str, object]]:
    """The messages with the tools described in the system message (a new one first, or the first one's text after
    the preamble)."""
    described = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    preamble = tool_format.preamble.format(tools=described)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{preamble}\n\n{messages[0].get('content', '')}"}, *messages[1:]]
    return [{"role": "system", "content": preamble}, *messages]


def tool_call_constraint(
    tools: list[dict], tool_choice: object, parallel: bool, tool_format: ToolFormat
) -> Constraint | None:
    """The grammar of the calls `tool_choice` allows: calls of any tool ("required") or of the one named, and nothing
    else; with "auto" (None), any text, but a call once begun is a valid call of a tool. None for "none"."""
    if tool_choice == "none" or not tools:
        return None
    functions = [tool["function"] for tool in tools]
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        functions = [function for function in functions if function["name"] == name]
        if not functions:
            raise ConstraintError(f"tool_choice names the function '{name}', which is not in tools.", "tool_choice")
    name_key, arguments_key = tool_format.call_body_keys()
    bodies = [
        {
            "type": "object",
            "properties": {
                name_key: {"const": function["name"]},
                arguments_key: function.get("parameters") or {"type": "object"},
            },
            "required": [name_key, arguments_key],
            "additionalProperties": False,
        }
        for function in functions
    ]
    schema = {"anyOf": bodies} if len(bodies) > 1 else bodies[0]
    body = f"body: %json {canonical_json({**schema, 'x-guidance': JSON_LAYOUT})}\n"
    if tool_choice in (None, "auto"):
        return Constraint("tools", "tools", _calls_among_text(tool_format, parallel) + body, best_effort=True)
    return Constraint(
        "tools", "tool_choice" if isinstance(tool_choice, dict) else "tools", _calls(tool_format, parallel) + body
    )


def _calls(tool_format: ToolFormat, parallel: bool) -> str:
    """Lark rules of a reply that is calls."""
    calls = f"call ({json.dumps(tool_format.separator)} call)*" if parallel else "call"
    if not tool_format.close:
        return f"start: {calls}\ncall: body\n"
    opening, closing = json.dumps(tool_format.open + "\n"), json.dumps("\n" + tool_format.close)
    return f"start: {calls}\ncall: {opening} body {closing}\n"


def _calls_among_text(tool_format: ToolFormat, parallel: bool) -> str:
    """Lark rules of a reply of text and calls, where the format allows them: text never holds the opening markup
    but as the start of a valid call. (Lexemes that end at the markup: llguidance's lexer does not back up to split
    text from markup, so text and markup are one lexeme.)"""
    if tool_format.calls_follow_text:
        markup, closing = re.escape(tool_format.open), json.dumps("\n" + tool_format.close)
        calls = "(OPENED call)*" if parallel else "(OPENED call)?"
        return (
            f"start: {calls} TEXT\n"
            f'call: "\\n" body {closing}\n'
            f"OPENED: /(?s:.*){markup}/ & ~/(?s:.*{markup}.+)/\n"
            f"TEXT: /(?s:.*)/ & ~/(?s:.*{markup}.*)/\n"
        )
    calls = f"body ({json.dumps(tool_format.separator)} body)*" if parallel else "body"
    return f"start: SPACE? {calls} | TEXT\nSPACE: /[ \\t\\n\\r]+/\nTEXT: /(?s:.*)/ & ~/[ \\t\\n\\r]*\\{{(?s:.*)/\n"
