"""A request body read as JSON: a JSON object the service can serve, or INVALID_ARGUMENT (400).

`json.loads` takes more than the service can use. Two such bodies would otherwise fail deep
inside a request with an internal error:

- nesting deeper than the parser's recursion allows (`RecursionError`, not `ValueError`); a body
  nested more than `MAX_DEPTH` levels is refused whether or not the parser managed it, since no
  field of the API nests that deep;
- a string holding a lone UTF-16 surrogate: JSON's `\\ud800` escape spells it, but it is not
  Unicode text, so no tokenizer or UTF-8 encoder can take it.

Both are refused here, naming where. Pure: bytes in, a dict or an error out.
"""

from __future__ import annotations

import json
from typing import Any

from cluster.runtime.errors import InvalidArgumentError

MAX_DEPTH = 64
"""Deepest nesting a body may have (the API's own fields nest four levels at most)."""


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object whose every string is Unicode text, nested at most
    `MAX_DEPTH` levels; InvalidArgumentError naming the problem otherwise."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise InvalidArgumentError(
            f"the request body is nested too deeply (at most {MAX_DEPTH} levels)"
        ) from None
    except ValueError as error:  # UnicodeDecodeError included
        raise InvalidArgumentError(f"the request body is not valid JSON ({error})") from None
    if not isinstance(body, dict):
        raise InvalidArgumentError(
            f"the request body must be a JSON object, got {type(body).__name__}"
        )
    check_json_value(body)
    return body


def check_json_value(value: object, max_depth: int = MAX_DEPTH) -> None:
    """Refuse nesting deeper than `max_depth` levels and any string (a value or a key) that is
    not Unicode text, naming the first place found."""
    stack: list[tuple[object, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if len(path) >= max_depth and isinstance(item, dict | list):
            raise InvalidArgumentError(
                f"the request body is nested too deeply at {_where(path)} "
                f"(at most {max_depth} levels)"
            )
        if isinstance(item, str):
            _check_text(item, path)
        elif isinstance(item, dict):
            for key, child in item.items():
                _check_text(key, (*path, "<key>"))
                stack.append((child, (*path, key)))
        elif isinstance(item, list):
            stack.extend((child, (*path, index)) for index, child in enumerate(item))


def _check_text(text: str, path: tuple[str | int, ...]) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = text[error.start]
        raise InvalidArgumentError(
            f"{_where(path)} holds a lone UTF-16 surrogate (\\u{ord(bad):04x}) at character "
            f"{error.start}: it is not Unicode text"
        ) from None


def _where(path: tuple[str | int, ...]) -> str:
    """`body.messages[0].content` for ("messages", 0, "content")."""
    where = "body"
    for part in path:
        where += f"[{part}]" if isinstance(part, int) else f".{part}"
    return where
