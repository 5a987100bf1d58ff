"""What a request's output must match: a JSON schema, any JSON object, a regex or a Lark grammar.

A plain value, validated when built; `compiled` turns it into llguidance's grammar (the engine is
imported only then, so clients and the CLI build grammars without loading it).
`cluster.runtime.constraint` masks tokens with it; docs/structured-outputs.md says how each API
asks for one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster.runtime.errors import InvalidArgumentError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

JSON_SCHEMA = "json_schema"
JSON_OBJECT = "json_object"
REGEX = "regex"
LARK = "lark"
GRAMMAR_KINDS = (JSON_SCHEMA, JSON_OBJECT, REGEX, LARK)

MAX_GRAMMAR_CHARS = 256 * 1024
"""Longest schema, regex or grammar text taken."""

_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
"""JSON is generated compact (`{"a":1}`): flexible whitespace lets a model pad a value with
newlines and spaces up to its token limit, and no client needs it."""


@dataclass(frozen=True)
class Grammar:
    """What the generated text must match: `kind` one of `GRAMMAR_KINDS`, and its `source`
    (the schema as JSON text, the regex, the Lark grammar; "" for any JSON object)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidArgumentError(
                f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}"
            )
        if not isinstance(self.source, str) or len(self.source) > MAX_GRAMMAR_CHARS:
            raise InvalidArgumentError(
                f"grammar.{self.kind} must be a string of at most {MAX_GRAMMAR_CHARS} characters"
            )
        if (self.kind == JSON_OBJECT) != (self.source == ""):
            raise InvalidArgumentError(
                f"grammar.{self.kind} must "
                + ("have no source" if self.kind == JSON_OBJECT else "not be empty")
            )

    def compiled(self) -> str:
        """The grammar in llguidance's form; InvalidArgumentError naming `grammar.<kind>` when
        the source is not one (a schema that is not JSON, say)."""
        # Imported here: clients build grammars without loading the engine.
        from llguidance import LLMatcher

        if self.kind == JSON_OBJECT:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        try:
            if self.kind == JSON_SCHEMA:
                return LLMatcher.grammar_from_json_schema(
                    _schema(self.source), defaults=_JSON_OPTIONS
                )
            if self.kind == REGEX:
                return LLMatcher.grammar_from_regex(self.source)
            return LLMatcher.grammar_from_lark(self.source)
        except (ValueError, TypeError, RuntimeError) as error:
            raise InvalidArgumentError(f"grammar.{self.kind} is not valid: {error}") from None


def _schema(source: str) -> dict[str, Any] | str:
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as error:
        raise InvalidArgumentError(f"grammar.json_schema is not JSON: {error}") from None
    if not isinstance(schema, dict):
        raise InvalidArgumentError("grammar.json_schema must be a JSON object (a schema)")
    return schema
