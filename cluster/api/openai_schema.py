"""OpenAI request bodies as Tandem takes them: every field checked, every error naming its field.

`parse_request(route, body)` turns the JSON body of `POST /v1/completions` ("completions") or
`POST /v1/chat/completions` ("chat.completions") into an `OpenAIRequest`, or raises
`OpenAIError` (INVALID_ARGUMENT, `cluster.api.openai_errors`) whose `param` is the field at
fault, as OpenAI's `param` is. It is pure: the model name, limits and tokenizer are
`cluster.api.openai`'s business.

A JSON `null` means the same as a field left out, everywhere. Fields taken:
- both routes: `model` (required), `max_tokens`, `temperature` (default 1.0, as OpenAI's),
  `top_p`, `seed` (any int64 or uint64; a negative one is taken modulo 2**64), `stop` (a string
  or a list of up to `MAX_STOP_SEQUENCES` non-empty strings), `stream`,
  `stream_options.include_usage` and `stream_options.continuous_usage_stats` (only with
  `stream: true`; the second, as vLLM's, puts the usage so far in every chunk and counts only
  with `include_usage`), `user` (accepted and recorded nowhere: the API key says who is billed,
  and the string may be personal data); vLLM's extra parameters that Tandem honours exactly:
  `ignore_eos` (bool), `min_tokens` (0..`max_tokens`), `stop_token_ids` (token ids),
  `skip_special_tokens` (bool, default true); and Tandem's own, sent as extra top-level fields
  as vLLM takes its extra parameters: `draft_tokens` (0..`MAX_DRAFT_TOKENS`, 0 = the target
  alone), `pipelined` (bool), `top_k` (0 or -1 = no limit, vLLM's spelling of it),
  `sampling_rule` (`auto`, `seed_exact` or `rejection`: `cluster.api.sampling_rule`);
- completions: `prompt`, a non-empty string, a list of token ids, or a one-element list of
  either (several prompts per request are refused);
- chat: `messages` (`cluster.api.openai_messages`) and `max_completion_tokens` (with
  `max_tokens` too, both must agree).
Any other field is accepted only at a value that changes nothing, or refused
(`cluster.api.openai_fields`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from cluster.api.openai_errors import OpenAIError
from cluster.api.openai_fields import check_fields
from cluster.api.openai_messages import parse_messages
from cluster.api.sampling_rule import AUTO, check_rule_name
from cluster.routing.draft_length_config import MAX_DRAFT_TOKENS
from cluster.routing.request import MAX_STOP_SEQUENCES
from cluster.runtime.errors import InvalidArgumentError

Route = Literal["completions", "chat.completions"]
MAX_INT32 = 2**31 - 1
DEFAULT_TEMPERATURE = 1.0
"""OpenAI's default: a request that sets no temperature samples (send 0 for greedy)."""


@dataclass(frozen=True)
class OpenAIRequest:
    """A checked request body; None where the body left a setting to the server."""

    model: str
    prompt: str | tuple[int, ...] | None = None
    """Completions: the prompt text, or its token ids."""
    messages: tuple[tuple[str, str], ...] = ()
    """Chat: (role, content) pairs."""
    conversation: tuple[dict[str, Any], ...] = ()
    """Chat: the messages as the chat template takes them (`role`, `content`, and
    `tool_calls` with arguments as objects, `tool_call_id`)."""
    max_tokens: int | None = None
    max_tokens_field: str = "max_tokens"
    """The field `max_tokens` came from (for errors about its value)."""
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    """Every chunk carries the usage so far (`stream_options.continuous_usage_stats` with
    `include_usage`, as vLLM)."""
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    draft_tokens: int | None = None
    pipelined: bool | None = None
    sampling_rule: str = AUTO

    @property
    def prompt_field(self) -> str:
        return "prompt" if self.prompt is not None else "messages"

    @property
    def has_tool_turns(self) -> bool:
        """Whether the conversation carries tool calls or their results (which only
        `conversation` holds: `messages` has their role and content alone)."""
        return any(m["role"] == "tool" or "tool_calls" in m for m in self.conversation)


def body_object(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    return body


def parse_stream(body: object) -> bool:
    """The body's `stream` flag, checked."""
    stream = body_object(body).get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise OpenAIError(f"stream must be true or false, got {stream!r}", "stream")
    return bool(stream)


def parse_request(route: Route, body: object) -> OpenAIRequest:
    """The checked request of `body` for `route`; raises `OpenAIError` naming a bad field."""
    fields = body_object(body)
    check_fields(route, fields)
    got = {name: value for name, value in fields.items() if value is not None}
    model = got.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError(
            "model is required: a non-empty string, the name GET /v1/models lists", "model"
        )
    prompt: str | tuple[int, ...] | None = None
    conversation: tuple[dict[str, Any], ...] = ()
    if route == "completions":
        if "prompt" not in got:
            raise OpenAIError("prompt is required", "prompt")
        prompt = _prompt(got["prompt"])
    else:
        conversation = parse_messages(got.get("messages"))
    stream = parse_stream(fields)
    max_tokens, max_tokens_field = _max_tokens(got)
    top_k = _int(got, "top_k", -1, MAX_INT32)
    seed = _int(got, "seed", -(2**63), 2**64 - 1)
    for flag in ("pipelined", "ignore_eos", "skip_special_tokens"):
        if not isinstance(got.get(flag, False), bool):
            raise OpenAIError(f"{flag} must be true or false", flag)
    include_usage, continuous_usage = _usage_options(got, stream)
    min_tokens = _int(got, "min_tokens", 0, MAX_INT32) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise OpenAIError(
            f"min_tokens ({min_tokens}) must be at most {max_tokens_field} ({max_tokens})",
            "min_tokens",
        )
    if not isinstance(got.get("user", ""), str):
        raise OpenAIError("user must be a string", "user")
    return OpenAIRequest(
        model=model,
        prompt=prompt,
        messages=tuple((m["role"], m["content"]) for m in conversation),
        conversation=conversation,
        max_tokens=max_tokens,
        max_tokens_field=max_tokens_field,
        temperature=_number(got, "temperature", DEFAULT_TEMPERATURE, "must be >= 0", 0.0),
        top_p=_number(got, "top_p", 1.0, "must satisfy 0 < top_p <= 1", 0.0, 1.0, open_low=True),
        top_k=0 if top_k is None or top_k == -1 else top_k,
        seed=None if seed is None else seed % 2**64,
        stop=_stop(got.get("stop")),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        ignore_eos=got.get("ignore_eos", False),
        min_tokens=min_tokens,
        stop_token_ids=_stop_token_ids(got.get("stop_token_ids")),
        skip_special_tokens=got.get("skip_special_tokens", True),
        draft_tokens=_int(got, "draft_tokens", 0, MAX_DRAFT_TOKENS),
        pipelined=got.get("pipelined"),
        sampling_rule=_sampling_rule(got),
    )


def _sampling_rule(fields: Mapping[str, Any]) -> str:
    try:
        return check_rule_name(fields.get("sampling_rule", AUTO), "sampling_rule")
    except InvalidArgumentError as error:
        raise OpenAIError(str(error), "sampling_rule") from None


_STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


def _usage_options(fields: Mapping[str, Any], stream: bool) -> tuple[bool, bool]:
    """(`include_usage`, whether every chunk carries the usage so far): vLLM counts
    `continuous_usage_stats` only together with `include_usage`."""
    if "stream_options" not in fields:
        return False, False
    options = fields["stream_options"]
    if not stream:
        raise OpenAIError("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(options, dict):
        raise OpenAIError("stream_options must be an object", "stream_options")
    for key, value in options.items():
        if key not in _STREAM_OPTIONS:
            raise OpenAIError(f"unknown field {key!r} in stream_options", f"stream_options.{key}")
        if value is not None and not isinstance(value, bool):
            raise OpenAIError(
                f"stream_options.{key} must be true or false", f"stream_options.{key}"
            )
    include_usage = bool(options.get("include_usage"))
    return include_usage, include_usage and bool(options.get("continuous_usage_stats"))


def _int(fields: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if type(value) is not int or not low <= value <= high:
        raise OpenAIError(f"{name} must be an integer in {low}..{high}, got {value!r}", name)
    return value


def _number(
    fields: Mapping[str, Any],
    name: str,
    default: float,
    rule: str,
    low: float,
    high: float = math.inf,
    open_low: bool = False,
) -> float:
    value = fields.get(name, default)
    if type(value) not in (int, float) or not math.isfinite(value):
        raise OpenAIError(f"{name} must be a finite number, got {value!r}", name)
    if value < low or (open_low and value == low) or value > high:
        raise OpenAIError(f"{name} {rule}, got {value!r}", name)
    return float(value)


def _max_tokens(fields: Mapping[str, Any]) -> tuple[int | None, str]:
    max_tokens = _int(fields, "max_tokens", 1, MAX_INT32)
    completion = _int(fields, "max_completion_tokens", 1, MAX_INT32)
    if max_tokens is not None and completion is not None and max_tokens != completion:
        raise OpenAIError(
            f"max_tokens ({max_tokens}) and max_completion_tokens ({completion}) differ: "
            "set one of them",
            "max_completion_tokens",
        )
    if completion is not None:
        return completion, "max_completion_tokens"
    return max_tokens, "max_tokens"


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise OpenAIError("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise OpenAIError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}", "stop")
    if "" in stops:
        raise OpenAIError("stop sequences must not be empty strings", "stop")
    return tuple(stops)


def _stop_token_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise OpenAIError("stop_token_ids must be a list of token ids", "stop_token_ids")
    if not all(0 <= t <= MAX_INT32 for t in value):
        raise OpenAIError("stop_token_ids must be in 0..2**31-1", "stop_token_ids")
    return tuple(value)


def _token_ids(value: list[Any]) -> tuple[int, ...] | None:
    """`value` as token ids, or None if it is not a list of ints."""
    if value and all(type(t) is int for t in value):
        if not all(0 <= t <= MAX_INT32 for t in value):
            raise OpenAIError("prompt token ids must be in 0..2**31-1", "prompt")
        return tuple(value)
    return None


def _prompt(value: object) -> str | tuple[int, ...]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one
    elif isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
        raise OpenAIError(
            f"one prompt per request is supported, got {len(value)}: send them one by one",
            "prompt",
        )
    if isinstance(value, str):
        if not value:
            raise OpenAIError("prompt must not be empty", "prompt")
        return value
    ids = _token_ids(value) if isinstance(value, list) else None
    if ids is None:
        raise OpenAIError(
            "prompt must be a non-empty string, a non-empty list of token ids, or a one-element "
            "list of either",
            "prompt",
        )
    return ids
