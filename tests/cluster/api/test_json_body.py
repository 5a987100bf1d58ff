"""Request bodies read as JSON: what the service can serve passes, what it cannot is a 400 that
says where (lone surrogates, nesting too deep)."""

from __future__ import annotations

import json

import pytest

from cluster.api.json_body import MAX_DEPTH, check_json_value, parse_json_object
from cluster.runtime.errors import InvalidArgumentError


def nested(depth: int) -> object:
    """A value `depth` containers deep: [[...[]...]]."""
    value: object = []
    for _ in range(depth - 1):
        value = [value]
    return value


def test_a_good_body_passes_unchanged() -> None:
    body = {"messages": [{"role": "user", "content": "héllo, 世界 👋"}], "n": 1, "stop": None}
    assert parse_json_object(json.dumps(body).encode()) == body
    assert parse_json_object(json.dumps(body, ensure_ascii=False).encode()) == body


def test_nesting_up_to_the_limit_passes_and_one_more_is_refused() -> None:
    check_json_value({"a": nested(MAX_DEPTH - 1)})  # the object is level 1
    with pytest.raises(InvalidArgumentError, match=r"nested too deeply at body\.a\[0\]"):
        check_json_value({"a": nested(MAX_DEPTH)})


def test_nesting_beyond_the_parser_is_a_clear_error() -> None:
    with pytest.raises(InvalidArgumentError, match="nested too deeply"):
        parse_json_object(b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        (b'{"prompt": "\\ud800"}', r"body\.prompt holds a lone UTF-16 surrogate \(\\ud800\) at "
                                   r"character 0"),
        (b'{"messages": [{"content": "ok \\udfff"}]}', r"body\.messages\[0\]\.content .*\\udfff"),
        (b'{"stop": ["a", "\\ud83d"]}', r"body\.stop\[1\] holds"),
        (b'{"x\\ud800": 1}', r"body\.<key> holds"),
    ],
)  # fmt: skip
def test_a_lone_surrogate_is_refused_where_it_stands(raw: bytes, where: str) -> None:
    with pytest.raises(InvalidArgumentError, match=where):
        parse_json_object(raw)


def test_a_surrogate_pair_is_one_character_and_passes() -> None:
    assert parse_json_object(b'{"prompt": "\\ud83d\\udc4b"}') == {"prompt": "👋"}
