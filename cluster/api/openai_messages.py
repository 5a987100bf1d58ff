"""The `messages` of an OpenAI chat body, checked, as the chat template takes them.

`parse_messages(value)` turns a non-empty list of messages into the conversation: roles system,
user, assistant and tool; content a string or a list of text parts, joined with newlines as
vLLM joins them; an assistant message may carry `tool_calls` instead of content (their
arguments parsed into objects, as chat templates write them), and a tool message needs the
`tool_call_id` it answers (and may keep its `name`). Fields a client may echo back from a
response (`name`, `refusal`, `tool_calls`...) are accepted when null or empty; anything else
is refused with an `OpenAIError` whose `param` is the message's field (`messages[1].content`).
Pure.
"""

from __future__ import annotations

import json
from typing import Any

from cluster.api.chat import MESSAGE_ROLES
from cluster.api.openai_errors import OpenAIError

_NULL_MESSAGE_FIELDS = frozenset(
    {"name", "refusal", "tool_calls", "function_call", "audio", "annotations"}
)
"""Message fields a client may echo back from a response, accepted when null (or empty)."""


def parse_messages(value: object) -> tuple[dict[str, Any], ...]:
    """The conversation of a chat body's `messages`; `OpenAIError` naming a bad field."""
    if not isinstance(value, list) or not value:
        raise OpenAIError("messages must be a non-empty list of messages", "messages")
    return tuple(_message(i, message) for i, message in enumerate(value))


_TOOL_TURN_FIELDS = {"assistant": "tool_calls", "tool": "tool_call_id"}
"""The field only that role may carry."""


def _message(i: int, message: object) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise OpenAIError(f"{where} must be an object with role and content", where)
    role = message.get("role")
    if role not in MESSAGE_ROLES:
        raise OpenAIError(
            f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}",
            f"{where}.role",
        )
    own = _TOOL_TURN_FIELDS.get(role)
    for key, value in message.items():
        if key == own or (key == "name" and role == "tool"):
            continue
        if key in _NULL_MESSAGE_FIELDS and value not in (None, []):
            raise OpenAIError(f"{where}.{key} is not supported", f"{where}.{key}")
        if key not in _NULL_MESSAGE_FIELDS | {"role", "content"}:
            raise OpenAIError(f"unknown field {key!r} in {where}", f"{where}.{key}")
    calls = message.get("tool_calls") if role == "assistant" else None
    if calls not in (None, []):
        turn: dict[str, Any] = {"role": role, "tool_calls": _tool_calls(where, calls)}
        content = message.get("content")
        turn["content"] = "" if content is None else _content(f"{where}.content", content)
        return turn
    turn = {"role": role, "content": _content(f"{where}.content", message.get("content"))}
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise OpenAIError(
                f"{where}.tool_call_id must be the id of the call it answers",
                f"{where}.tool_call_id",
            )
        turn["tool_call_id"] = call_id
        if isinstance(message.get("name"), str):
            turn["name"] = message["name"]
    return turn


def _tool_calls(where: str, calls: object) -> list[dict[str, Any]]:
    """An assistant message's calls, their arguments parsed (chat templates write them as
    JSON objects, as vLLM hands them over)."""
    where = f"{where}.tool_calls"
    if not isinstance(calls, list):
        raise OpenAIError(f"{where} must be a list of calls", where)
    parsed = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or call.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not isinstance(call.get("id", ""), str)
        ):
            raise OpenAIError(
                f'{at} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}',
                at,
            )
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError):
            arguments = None
        if not isinstance(arguments, dict):
            raise OpenAIError(
                f"{at}.function.arguments must be a JSON object as text", f"{at}.function.arguments"
            )
        parsed.append(
            {
                "id": call.get("id", ""),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return parsed


def _content(where: str, content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = [
            part.get("text")
            for part in content
            if isinstance(part, dict)
            and part.get("type") == "text"
            and set(part) <= {"type", "text"}
        ]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "\n".join(texts)  # type: ignore[arg-type]
    raise OpenAIError(
        f"{where} must be a string or a non-empty list of text parts "
        '({"type": "text", "text": ...})',
        where,
    )
