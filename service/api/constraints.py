"""Constrained decoding as requests ask for it: OpenAI's `response_format`, vLLM's `structured_outputs` and its
older `guided_*` fields, each turned into one llguidance grammar (a string the worker compiles into matchers).

A request names at most one constraint. Building and checking its grammar happens here, before anything is
scheduled, so a schema, regex or grammar the engine cannot enforce is a 400 that names the field. JSON comes
out with fixed separators (`", "` and `": "`) and no free whitespace: a small model sampled at a temperature
otherwise loops on whitespace (docs/structured_outputs_research.md, table 4).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance
from llguidance import LLMatcher

from service.contract.limits import MAX_GRAMMAR_CHARS

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT: dict[str, object] = {"type": "object"}
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tools")  # the metrics' label values


class GrammarError(ValueError):
    """A constraint llguidance cannot build or enforce; the message says why."""


class ConstraintError(ValueError):
    """Constraint fields that contradict each other or are malformed; `param` names the field (a 400 at the edge)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Constraint:
    """One request's constraint: what it is, the field that gave it, and its text in a canonical form (a schema as
    compact JSON, the choices as a JSON list), which keys the compiled-grammar cache."""

    kind: str  # one of KINDS
    param: str  # the request field errors name
    text: str
    best_effort: bool = False  # one the engine cannot enforce is left out, not refused (tool_choice auto's)

    def grammar(self) -> str:
        """The llguidance grammar; GrammarError if it is not one llguidance can enforce."""
        grammar = _build(self)
        if len(grammar) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"the grammar has {len(grammar)} characters; at most {MAX_GRAMMAR_CHARS} are served")
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            raise GrammarError(messages[0].strip())
        return grammar


def _build(constraint: Constraint) -> str:
    try:
        if constraint.kind in ("json_schema", "json_object"):
            return LLMatcher.grammar_from_json_schema(constraint.text, overrides=JSON_LAYOUT)
        if constraint.kind == "regex":
            return LLMatcher.grammar_from_regex(constraint.text)
        if constraint.kind == "choice":
            return llguidance.grammar_from("choice", json.loads(constraint.text))
        return llguidance.grammar_from("grammar", constraint.text)  # Lark, or GBNF (llama.cpp's EBNF) converted
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


def canonical_json(value: object) -> str:
    """Compact JSON. Keys keep their order: a schema's properties come out in the order it lists them."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def json_schema_constraint(schema: object, param: str) -> Constraint:
    """A JSON Schema given as an object, or as a JSON text (vLLM accepts both)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ConstraintError(f"Invalid value for '{param}': not a JSON text ({exc}).", param) from None
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(f"Invalid value for '{param}': a JSON Schema is an object.", param)
    return Constraint("json_schema", param, canonical_json(schema))


def choice_constraint(choices: list[str], param: str) -> Constraint:
    if not choices:
        raise ConstraintError(f"Invalid value for '{param}': give at least one choice.", param)
    return Constraint("choice", param, canonical_json(choices))


def check_constraint_use(constraint: Constraint | None, ignore_eos: bool) -> None:
    """A constraint with `ignore_eos` is a contradiction: the grammar decides where the output ends."""
    if constraint is not None and ignore_eos:
        raise ConstraintError(
            f"ignore_eos cannot go with '{constraint.param}': the grammar decides where the output ends.", "ignore_eos"
        )


def only_one(found: list[Constraint]) -> Constraint | None:
    """The request's one constraint; 400 naming both fields if it gave two."""
    if len(found) > 1:
        raise ConstraintError(
            f"'{found[0].param}' and '{found[1].param}' both constrain the output; give one of them.", found[1].param
        )
    return found[0] if found else None
