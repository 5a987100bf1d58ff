"""What the Tandem clients hand back, and the one place they convert to and from the wire.

`build_request` turns a prompt (text, token ids, or chat messages) and settings into a
`GenerateRequest`; `result_from_response`
and `chunk_from_proto` turn the server's messages into frozen dataclasses. The finish reason is
a plain string derived from the proto enum's name ("length", "stop", "cancelled"), the same
strings as `cluster.routing.request.FinishReason` values, so this module needs no torch.

The client checks only what the wire cannot carry (a negative seed, a count past int32): the
server owns every other rule, so the two can never disagree. Such a value raises
`TandemClientError` with INVALID_ARGUMENT, as the server would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import grpc

from cluster.runtime.grammar import JSON_OBJECT, Grammar
from protos import generate_pb2, sampling_pb2

MIN_INT32 = -(2**31)
MAX_INT32 = 2**31 - 1
MAX_UINT32 = 2**32 - 1
MAX_UINT64 = 2**64 - 1
_FINISH_REASON_PREFIX = "FINISH_REASON_"


class TandemClientError(Exception):
    """A failed call: the gRPC status code, the server's message, and for a limit that frees up
    with time, how many seconds to wait before retrying (None if the server did not say)."""

    def __init__(
        self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class RequestStats:
    """Token counts and speculation counters of one request."""

    num_prompt_tokens: int
    num_generated_tokens: int
    num_drafted: int
    num_accepted: int
    num_verify_passes: int
    pipeline_hits: int
    pipeline_misses: int
    drafted_by_position: tuple[int, ...] = ()
    accepted_by_position: tuple[int, ...] = ()
    predraft_hits: int = 0
    predraft_misses: int = 0
    suffix_drafted: int = 0
    suffix_accepted: int = 0
    model_drafted: int = 0
    model_accepted: int = 0
    draft_mode: str = ""
    draft_mode_reason: str = ""


@dataclass(frozen=True)
class GenerateResult:
    """A whole generation and its counters."""

    request_id: str
    tokens: tuple[int, ...]
    text: str
    finish_reason: str
    """"length" (max_tokens reached), "stop" (end of sequence or a stop string), "cancelled"."""
    num_prompt_tokens: int
    num_drafted: int
    num_accepted: int
    num_verify_passes: int
    pipeline_hits: int
    pipeline_misses: int
    drafted_by_position: tuple[int, ...] = ()
    """Per draft position i: verify passes whose block had a token at position i."""
    accepted_by_position: tuple[int, ...] = ()
    """Per draft position i: verify passes that accepted the block's first i + 1 tokens."""
    predraft_hits: int = 0
    """Pre-drafted rounds whose verdict was one of the outcomes drafted for."""
    predraft_misses: int = 0
    """Pre-drafted rounds whose verdict was none of them."""
    suffix_drafted: int = 0
    """Of `num_drafted`: tokens the suffix drafter proposed."""
    suffix_accepted: int = 0
    """Of `num_accepted`: those of them accepted."""
    model_drafted: int = 0
    """Of `num_drafted`: tokens the draft model proposed (the rest: suffix and lookup)."""
    model_accepted: int = 0
    """Of `num_accepted`: those of them accepted."""
    draft_mode: str = ""
    """How the request drafted last: "model", "lookup" or "alone" (empty: no speculation)."""
    draft_mode_reason: str = ""

    @property
    def num_generated_tokens(self) -> int:
        return len(self.tokens)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over drafted draft tokens; None when nothing was drafted."""
        return self.num_accepted / self.num_drafted if self.num_drafted else None


@dataclass(frozen=True)
class StreamChunk:
    """Tokens new in this chunk and their text; the last chunk has finish reason and stats."""

    request_id: str
    tokens: tuple[int, ...]
    text: str
    finish_reason: str | None = None
    stats: RequestStats | None = None


def _check_int(name: str, value: int, low: int, high: int, range_text: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise TandemClientError(
            grpc.StatusCode.INVALID_ARGUMENT, f"{name} must be in {range_text}, got {value!r}"
        )
    return value


def _int32(name: str, value: int) -> int:
    return _check_int(name, value, MIN_INT32, MAX_INT32, "-2**31..2**31-1")


class RequestSettings(TypedDict, total=False):
    """The settings `build_request` takes besides the prompt and `max_tokens` (the clients'
    `generate` and `stream` pass them on); its defaults apply to those left out."""

    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: Sequence[str]
    draft_tokens: int | None
    pipelined: bool | None
    predraft_fan_out: int | None
    min_tokens: int
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    skip_special_tokens: bool
    grammar: Grammar | None


ChatMessages = Sequence[Mapping[str, str]]
"""Chat messages as the clients take them: `[{"role": "user", "content": "..."}]`."""


def build_request(
    prompt: str | Sequence[int] | None = None,
    *,
    messages: ChatMessages | None = None,
    max_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    draft_tokens: int | None = None,
    pipelined: bool | None = None,
    predraft_fan_out: int | None = None,
    sampling_rule: str = "auto",
    min_tokens: int = 0,
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    skip_special_tokens: bool = True,
    grammar: Grammar | None = None,
) -> generate_pb2.GenerateRequest:
    """The request message; None for seed, draft_tokens, pipelined or predraft_fan_out leaves
    the field unset, which means the server's default, as does `sampling_rule` `auto`
    (`seed_exact` or `rejection` force a rule: `cluster.api.sampling_rule`). The prompt is
    `prompt` (text or token ids) or `messages` (role and content of each, rendered by the
    server's chat template), not both. `min_tokens` (end tokens forbidden before),
    `stop_token_ids` (token ids that end the output like end-of-sequence), `ignore_eos`
    (generate past end-of-sequence) and `skip_special_tokens` (leave special tokens out of the
    text) are vLLM's parameters of the same names. `grammar` constrains the output
    (`cluster.runtime.constraint.Grammar`: a JSON schema, any JSON object, a regex or a Lark
    grammar; docs/structured-outputs.md)."""
    if prompt is not None and messages is not None:
        raise TandemClientError(
            grpc.StatusCode.INVALID_ARGUMENT, "give a prompt or chat messages, not both"
        )
    request = generate_pb2.GenerateRequest(
        max_tokens=_int32("max_tokens", max_tokens),
        sampling=sampling_pb2.SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=_int32("top_k", top_k),
            rule=_rule(sampling_rule),
        ),
        stop=list(stop),
        min_tokens=_check_int("min_tokens", min_tokens, 0, MAX_UINT32, "0..2**32-1"),
        stop_token_ids=[_int32(f"stop_token_ids[{i}]", t) for i, t in enumerate(stop_token_ids)],
        ignore_eos=ignore_eos,
    )
    if not skip_special_tokens:
        request.skip_special_tokens = False
    if grammar is not None and grammar.kind == JSON_OBJECT:
        request.grammar.json_object = True
    elif grammar is not None:
        setattr(request.grammar, grammar.kind, grammar.source)
    if isinstance(prompt, str):
        request.text = prompt
    elif messages is not None:
        request.chat.messages.extend(_chat_message(i, m) for i, m in enumerate(messages))
        # An empty list must still select `chat`, so the server names the right error.
        request.chat.SetInParent()
    elif prompt is not None:
        request.token_ids.ids.extend(
            _int32(f"token_ids[{i}]", token) for i, token in enumerate(prompt)
        )
        # An empty list must still select `token_ids`, so the server names the right error.
        request.token_ids.SetInParent()
    if seed is not None:
        # Worded as the server words it.
        request.seed = _check_int("seed", seed, 0, MAX_UINT64, "0..2**64-1")
    if draft_tokens is not None:
        request.speculation.draft_tokens = _int32("draft_tokens", draft_tokens)
    if pipelined is not None:
        request.speculation.pipelined = pipelined
    if predraft_fan_out is not None:
        request.speculation.predraft_fan_out = _int32("predraft_fan_out", predraft_fan_out)
    return request


_RULES = {
    "auto": sampling_pb2.SAMPLING_RULE_UNSPECIFIED,
    "seed_exact": sampling_pb2.SAMPLING_RULE_SEED_EXACT,
    "rejection": sampling_pb2.SAMPLING_RULE_REJECTION,
}


def _rule(name: str) -> sampling_pb2.SamplingRule:
    if name not in _RULES:
        raise TandemClientError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"sampling_rule must be one of {', '.join(_RULES)}, got {name!r}",
        )
    return _RULES[name]


def _chat_message(i: int, message: Mapping[str, str]) -> generate_pb2.ChatMessage:
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not isinstance(content, str):
        raise TandemClientError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"messages[{i}] must have a string role and a string content",
        )
    return generate_pb2.ChatMessage(role=role, content=content)


def usage_from_proto(usage: generate_pb2.TenantUsage) -> dict[str, int | str]:
    """A tenant's usage counters by name, zeros included (ListFields would leave those out)."""
    return {field.name: getattr(usage, field.name) for field in usage.DESCRIPTOR.fields}


def finish_reason_name(value: generate_pb2.FinishReason) -> str | None:
    """ "length", "stop" or "cancelled"; None for FINISH_REASON_UNSPECIFIED (not finished)."""
    if value == generate_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    return generate_pb2.FinishReason.Name(value).removeprefix(_FINISH_REASON_PREFIX).lower()


def _speculation_fields(stats: generate_pb2.SpeculationStats) -> dict[str, Any]:
    """The speculation counters that `GenerateResult` and `RequestStats` both carry."""
    return {
        "num_drafted": stats.num_drafted,
        "num_accepted": stats.num_accepted,
        "num_verify_passes": stats.num_verify_passes,
        "pipeline_hits": stats.pipeline_hits,
        "pipeline_misses": stats.pipeline_misses,
        "predraft_hits": stats.predraft_hits,
        "predraft_misses": stats.predraft_misses,
        "suffix_drafted": stats.suffix_drafted,
        "suffix_accepted": stats.suffix_accepted,
        "model_drafted": stats.model_drafted,
        "model_accepted": stats.model_accepted,
        "draft_mode": stats.draft_mode,
        "draft_mode_reason": stats.draft_mode_reason,
        "drafted_by_position": tuple(stats.drafted_by_position),
        "accepted_by_position": tuple(stats.accepted_by_position),
    }


def result_from_response(response: generate_pb2.GenerateResponse) -> GenerateResult:
    finish_reason = finish_reason_name(response.finish_reason)
    if finish_reason is None:
        raise TandemClientError(
            grpc.StatusCode.UNKNOWN, "the server's response has no finish reason"
        )
    return GenerateResult(
        request_id=response.request_id,
        tokens=tuple(response.token_ids),
        text=response.text,
        finish_reason=finish_reason,
        num_prompt_tokens=response.usage.prompt_tokens,
        **_speculation_fields(response.speculation),
    )


def chunk_from_proto(chunk: generate_pb2.GenerateChunk) -> StreamChunk:
    finish_reason = finish_reason_name(chunk.finish_reason)
    stats = None
    if finish_reason is not None:
        stats = RequestStats(
            num_prompt_tokens=chunk.usage.prompt_tokens,
            num_generated_tokens=chunk.usage.completion_tokens,
            **_speculation_fields(chunk.speculation),
        )
    return StreamChunk(
        request_id=chunk.request_id,
        tokens=tuple(chunk.token_ids),
        text=chunk.text,
        finish_reason=finish_reason,
        stats=stats,
    )
