"""The OpenAI-compatible API as a plain class: JSON bodies in, OpenAI's response shapes out.

`OpenAIService` serves `GET /v1/models`, `POST /v1/completions` and `POST /v1/chat/completions`
(and Tandem's own `POST /v1/audit`, through `cluster.api.audit`) over a `TandemService`,
with no HTTP and no Ray: an HTTP adapter parses the JSON, passes the body and the caller (API
key, deadline) here, and frames what comes back. Every call is
authenticated first, like the gRPC API; the body is then checked field by field
(`cluster.api.openai_schema`: unsupported and unknown fields are errors naming the field).

The request runs as a Tandem `GenerateRequest`: a completion's prompt is tokenized like a text
prompt; chat messages are rendered by the target's chat template (`cluster.api.chat`), as the
gRPC API's `chat` prompt is. The output is the Tandem request's, token for token: greedy
(`temperature: 0`) matches the target model alone, a `seed` makes sampling repeatable.

Defaults: `max_tokens` absent is 16 for a completion (OpenAI's default) and, for a chat, the room
left: the context left after the prompt (when the service knows the verifiers' context),
capped by the service's `max_tokens_limit` and the tenant's `max_tokens_per_request`, so that a
request that asks for nothing never fails on a limit. A completion's default is capped the same
way.

vLLM's extras map onto the Tandem request's fields of the same names: `ignore_eos`,
`min_tokens` (at most the request's `max_tokens`, its default included), `stop_token_ids`
(checked against the vocabulary) and `skip_special_tokens`.

Responses: ids are `cmpl-<request id>` / `chatcmpl-<request id>` (the Tandem request id, which
Tandem's gRPC `Cancel` takes); `finish_reason` is "length" (max_tokens reached) or "stop" (an
end-of-sequence token, one of `stop_token_ids` or a stop string). A request cancelled through
gRPC's `Cancel` also ends "stop": OpenAI has no word for it, and strict clients refuse values
outside their enum. `logprobs` is always null. `usage` has OpenAI's three counts plus a
`speculation` object: `drafted`, `accepted` (draft tokens), `acceptance_rate` (null when
nothing was drafted), `verify_passes` and `tokens_per_verify_pass` (completion tokens per
target pass).

Streams: one chunk per piece of newly final text (the first chat chunk carries `role`), the one
with `finish_reason` last; with `stream_options.include_usage`, every chunk has `usage: null`
and a final chunk with no choices carries the usage, as OpenAI sends it; with
`stream_options.continuous_usage_stats` too, every chunk with choices carries instead the usage
so far, as vLLM sends it: `prompt_tokens`, `completion_tokens` (the tokens generated up to and
including that chunk's) and `total_tokens`. Closing the iterator
early closes the Tandem stream, which frees the request's sessions on both replicas.

Errors: `error_response` maps any exception to OpenAI's error body, HTTP status and headers.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Generator
from contextlib import closing
from typing import TYPE_CHECKING, Any, Protocol

from cluster.api.audit import HTTP_FIELDS, audit_json
from cluster.api.auto_tool_calls import AutoToolDeltas
from cluster.api.caller import ANONYMOUS_CALL, Caller
from cluster.api.openai_schema import (
    ModelNotFoundError,
    OpenAIError,
    OpenAIRequest,
    Route,
    body_object,
    parse_request,
    parse_stream,
)
from cluster.api.openai_structured import (
    Structured,
    ToolCallDeltas,
    parse_structured,
    tool_message,
)
from cluster.api.request_reader import check_context
from cluster.api.sampling_rule import rule_to_proto
from cluster.api.status import INTERNAL_ERROR_MESSAGE, status_of
from cluster.api.tool_format import ToolFormat
from cluster.api.tool_formats import choose_format
from cluster.runtime.errors import InvalidArgumentError, TandemError
from cluster.wire.convert import grammar_to_wire
from protos import generate_pb2, sampling_pb2
from verifier.config import OWN_DTYPE, check_reference_dtype

if TYPE_CHECKING:
    from cluster.api.service import TandemService
    from cluster.api.tenants import Tenant

__all__ = [
    "ModelNotFoundError",
    "OpenAIError",
    "OpenAIService",
    "Route",
    "error_response",
    "served_model_name",
]

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""`max_tokens` of a completion that sets none: OpenAI's default."""
OWNED_BY = "tandem"
AUDIT_DTYPE_FIELD = "audit_dtype"
"""The `POST /v1/audit` body's field for `AuditRequest.dtype`."""
_OBJECTS = {"completions": "text_completion", "chat.completions": "chat.completion"}
_ID_PREFIXES = {"completions": "cmpl-", "chat.completions": "chatcmpl-"}
_FINISH_REASONS = {
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_CANCELLED: "stop",
}


class ModelSource(Protocol):
    """What names the served model: `cluster.config.ModelsConfig` (not imported: it sits above
    this layer)."""

    @property
    def preset(self) -> str: ...

    @property
    def target(self) -> str | None: ...


def served_model_name(models: ModelSource) -> str:
    """The model name clients send: the preset's (`tiny`, `qwen-coder`), or the target's source
    when the config overrides the target."""
    return models.target if models.target else models.preset


class OpenAIService:
    """OpenAI-compatible completions and chat over a TandemService (a plain class: no HTTP, no
    Ray); `model_name` is the one model it serves. `tool_format`: the model's tool-call syntax
    for "auto" tool choice; by default the service config's `tool_parser`, or the one the
    target's chat template asks for (`cluster.api.tool_formats`)."""

    def __init__(
        self,
        service: TandemService,
        model_name: str,
        tool_format: ToolFormat | None = None,
    ) -> None:
        self.service = service
        self.model_name = model_name
        self.tool_format = tool_format or choose_format(
            service.config.tool_parser, service.reader.chat_template
        )
        self._created = int(time.time())

    def models(self, caller: Caller = ANONYMOUS_CALL) -> dict[str, Any]:
        """The body of `GET /v1/models`."""
        self.service.tenants.authenticate(caller.authorization)
        model = {"id": self.model_name, "object": "model", "created": self._created}
        return {"object": "list", "data": [{**model, "owned_by": OWNED_BY}]}

    def wants_stream(self, body: object) -> bool:
        """Whether `body` asks for a stream; raises `OpenAIError` for a bad `stream`."""
        return parse_stream(body)

    def complete(
        self,
        route: Route,
        body: object,
        caller: Caller = ANONYMOUS_CALL,
        is_active: Callable[[], bool] = lambda: True,
    ) -> dict[str, Any]:
        """The unary response body (the caller picked unary with `wants_stream`; `stream` is
        not consulted again); `is_active` returning False stops the request (the HTTP client
        went away), frees its sessions and raises `RequestCancelledError`."""
        created = int(time.time())
        _, message, structured = self._prepare(route, body, caller)
        response = self.service.generate(message, is_active, caller)
        text = response.text
        reason = _FINISH_REASONS[response.finish_reason]
        choice: dict[str, Any] = (
            {"index": 0, "text": text}
            if route == "completions"
            else {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None}}
        )
        if structured.calling is not None:
            choice["message"], reason = tool_message(structured.calling, text, reason)
        choice |= {"logprobs": None, "finish_reason": reason}
        return {
            **self._head(route, _OBJECTS[route], response.request_id, created),
            "choices": [choice],
            "usage": usage_body(response.usage, response.speculation),
        }

    def audit(
        self,
        body: object,
        caller: Caller = ANONYMOUS_CALL,
        is_active: Callable[[], bool] = lambda: True,
    ) -> dict[str, Any]:
        """The body of `POST /v1/audit`: a completions body (`cluster.api.openai_schema`) plus
        an optional `audit_dtype` ("" or "float32"), run, replayed through the plain target and
        compared (`cluster.api.audit.Auditor.run`); the answer is `audit_json`'s. Errors name
        the body's field (`OpenAIError`, `NotReplayableError`: HTTP 400)."""
        fields = dict(body_object(body))
        dtype = fields.pop(AUDIT_DTYPE_FIELD, None)
        if dtype is None:
            dtype = OWN_DTYPE
        try:
            check_reference_dtype(dtype, AUDIT_DTYPE_FIELD)
        except InvalidArgumentError as error:
            raise OpenAIError(str(error), AUDIT_DTYPE_FIELD) from error
        if self.wants_stream(fields):
            raise OpenAIError(
                "an audit answers once, when it is done: stream must be false", "stream"
            )
        _, message = self.to_generate_request("completions", fields, caller)
        request = generate_pb2.AuditRequest(request=message, dtype=dtype)
        return audit_json(self.service.auditor.run(request, caller, is_active, HTTP_FIELDS))

    def stream(
        self, route: Route, body: object, caller: Caller = ANONYMOUS_CALL
    ) -> Generator[dict[str, Any], None, None]:
        """Chunk bodies in order; errors before the first chunk are raised by the first
        `next()`. Closing the generator early ends the Tandem request."""
        created = int(time.time())
        request, message, structured = self._prepare(route, body, caller)
        calling = structured.calling
        auto = AutoToolDeltas(calling.tool_format) if calling and calling.tool_format else None
        calls = ToolCallDeltas(calling) if calling is not None and auto is None else None
        chunk_object = "text_completion" if route == "completions" else "chat.completion.chunk"
        usage: dict[str, Any] = {"usage": None} if request.include_usage else {}
        num_prompt_tokens, num_generated = len(message.token_ids.ids), 0
        first = True
        with closing(self.service.stream(message, caller)) as chunks:
            for chunk in chunks:
                head = self._head(route, chunk_object, chunk.request_id, created)
                num_generated += len(chunk.token_ids)
                if request.continuous_usage:
                    usage = {"usage": _counts(num_prompt_tokens, num_generated)}
                finished = chunk.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED
                reason = _FINISH_REASONS[chunk.finish_reason] if finished else None
                if route == "completions":
                    if chunk.text or finished:
                        choice = {"index": 0, "text": chunk.text, "logprobs": None}
                        yield {**head, "choices": [choice | {"finish_reason": reason}], **usage}
                elif auto is not None:
                    deltas = auto.deltas(chunk.text, finished)
                    if finished:
                        deltas = deltas or [{}]
                    for n, piece in enumerate(deltas):
                        last = finished and n == len(deltas) - 1
                        if first:
                            piece = {"role": "assistant"} | piece
                        choice = {"index": 0, "delta": piece, "logprobs": None}
                        end = auto.finish_reason(reason) if last and reason else None
                        yield {**head, "choices": [choice | {"finish_reason": end}], **usage}
                        first = False
                elif calls is not None:
                    delta = calls.delta(chunk.text, first, reason)
                    if delta is not None or finished:
                        reason = calls.finish(reason) if reason is not None else None
                        choice = {"index": 0, "delta": delta or {}, "logprobs": None}
                        yield {**head, "choices": [choice | {"finish_reason": reason}], **usage}
                        first = False
                elif chunk.text or finished or first:
                    delta = {"role": "assistant"} if first else {}
                    if chunk.text or first:
                        delta["content"] = chunk.text
                    choice = {"index": 0, "delta": delta, "logprobs": None}
                    yield {**head, "choices": [choice | {"finish_reason": reason}], **usage}
                    first = False
                if finished and request.include_usage:
                    yield {
                        **head,
                        "choices": [],
                        "usage": usage_body(chunk.usage, chunk.speculation),
                    }

    def to_generate_request(
        self, route: Route, body: object, caller: Caller = ANONYMOUS_CALL
    ) -> tuple[OpenAIRequest, generate_pb2.GenerateRequest]:
        """The checked body and the Tandem request it asks for (the prompt as token ids)."""
        request, message, _ = self._prepare(route, body, caller)
        return request, message

    def _prepare(
        self, route: Route, body: object, caller: Caller
    ) -> tuple[OpenAIRequest, generate_pb2.GenerateRequest, Structured]:
        """`to_generate_request`'s, and the constraint or tool call the body asks for."""
        tenant = self.service.tenants.authenticate(caller.authorization)
        request = parse_request(route, body)
        structured = parse_structured(route, body_object(body), self.tool_format)
        if request.model != self.model_name:
            raise ModelNotFoundError(
                f"the model {request.model!r} does not exist: this server serves "
                f"{self.model_name!r}",
                "model",
            )
        prompt_tokens = self._prompt_tokens(request, structured)
        max_tokens = self._max_tokens(request, len(prompt_tokens), tenant)
        message = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt_tokens),
            max_tokens=max_tokens,
            sampling=sampling_pb2.SamplingParams(
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=request.top_k,
                rule=rule_to_proto(request.sampling_rule),
            ),
            stop=request.stop,
            min_tokens=request.min_tokens,
            stop_token_ids=self._stop_token_ids(request),
            ignore_eos=request.ignore_eos,
        )
        if not request.skip_special_tokens:
            message.skip_special_tokens = False
        if request.seed is not None:
            message.seed = request.seed
        if request.draft_tokens is not None:
            message.speculation.draft_tokens = request.draft_tokens
        if request.pipelined is not None:
            message.speculation.pipelined = request.pipelined
        if structured.grammar is not None:
            message.grammar.CopyFrom(grammar_to_wire(structured.grammar))
            try:
                self.service.reader.grammar(message.grammar)
            except InvalidArgumentError as error:
                raise OpenAIError(str(error), structured.source_field) from error
        return request, message, structured

    def _stop_token_ids(self, request: OpenAIRequest) -> tuple[int, ...]:
        try:
            return self.service.reader.check_stop_token_ids(request.stop_token_ids)
        except InvalidArgumentError as error:
            raise OpenAIError(str(error), "stop_token_ids") from error

    def _prompt_tokens(self, request: OpenAIRequest, structured: Structured) -> tuple[int, ...]:
        prompt = generate_pb2.GenerateRequest()
        if isinstance(request.prompt, str):
            prompt.text = request.prompt
        elif structured.tools or request.has_tool_turns:
            try:  # tools, calls and their results go into the prompt through the chat template
                prompt.text = self.service.reader.chat_prompt(
                    request.conversation, structured.tools
                )
            except InvalidArgumentError as error:
                raise OpenAIError(
                    str(error), "tools" if structured.tools else "messages"
                ) from error
        elif request.prompt is not None:
            prompt.token_ids.ids.extend(request.prompt)
        else:
            prompt.chat.messages.extend(
                generate_pb2.ChatMessage(role=role, content=content)
                for role, content in request.messages
            )
        try:
            return self.service.reader.prompt_tokens(prompt)
        except InvalidArgumentError as error:  # e.g. text that encodes to no tokens
            raise OpenAIError(str(error), request.prompt_field) from error

    def _max_tokens(self, request: OpenAIRequest, num_prompt_tokens: int, tenant: Tenant) -> int:
        """The request's `max_tokens`, or its default; checked against the server's limits."""
        service_limit = self.service.config.max_tokens_limit
        context = self.service.max_context_tokens
        if request.max_tokens is None:
            room = [service_limit, tenant.config.max_tokens_per_request]
            if context is not None:
                room.append(context - num_prompt_tokens)
            if request.prompt is not None:
                room.append(DEFAULT_COMPLETION_MAX_TOKENS)
            max_tokens = max(1, min(r for r in room if r is not None))
        else:
            max_tokens = request.max_tokens
        field = request.max_tokens_field if request.max_tokens is not None else None
        if request.min_tokens > max_tokens:  # a default below it (a given one was checked)
            raise OpenAIError(
                f"min_tokens ({request.min_tokens}) must be at most the default max_tokens "
                f"({max_tokens}) here: set max_tokens",
                "min_tokens",
            )
        if max_tokens > service_limit:
            raise OpenAIError(
                f"{field} must be <= {service_limit} on this server, got {max_tokens}", field
            )
        if context is not None:
            try:
                check_context(num_prompt_tokens, max_tokens, context)
            except InvalidArgumentError as error:
                raise OpenAIError(str(error), field or request.prompt_field) from error
        return max_tokens

    def _head(self, route: Route, kind: str, request_id: str, created: int) -> dict[str, Any]:
        return {
            "id": _ID_PREFIXES[route] + request_id,
            "object": kind,
            "created": created,
            "model": self.model_name,
            "system_fingerprint": None,
        }


def _counts(prompt: int, completion: int) -> dict[str, int]:
    """OpenAI's three token counts."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def usage_body(
    usage: generate_pb2.Usage, speculation: generate_pb2.SpeculationStats
) -> dict[str, Any]:
    """OpenAI's `usage`, plus Tandem's `speculation` counters."""
    prompt, completion = usage.prompt_tokens, usage.completion_tokens
    drafted, accepted = speculation.num_drafted, speculation.num_accepted
    passes = speculation.num_verify_passes
    return {
        **_counts(prompt, completion),
        "speculation": {
            "drafted": drafted,
            "accepted": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "verify_passes": passes,
            "tokens_per_verify_pass": completion / passes if passes else None,
        },
    }


_HTTP_ERRORS: dict[str, tuple[int, str, str | None]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error", None),
    "FAILED_PRECONDITION": (400, "invalid_request_error", None),
    "UNAUTHENTICATED": (401, "authentication_error", "invalid_api_key"),
    "PERMISSION_DENIED": (403, "permission_error", "permission_denied"),
    "NOT_FOUND": (404, "invalid_request_error", "not_found"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error", "rate_limit_exceeded"),
    "DEADLINE_EXCEEDED": (504, "timeout_error", "deadline_exceeded"),
    "UNAVAILABLE": (503, "server_error", "service_unavailable"),
}
"""gRPC status -> (HTTP status, OpenAI error `type`, default `code`)."""
_INTERNAL = (500, "server_error", "internal_error")


def error_response(error: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(HTTP status, OpenAI's error body, extra headers) for `error`.

    A `TandemError` of a mapped status keeps its message; `param` is the field an `OpenAIError`
    names; RESOURCE_EXHAUSTED with a retry hint gets `Retry-After` in whole seconds, rounded up.
    Anything else (a bug, or a status a client should never see) is 500 "internal error": the
    details go to the log, never to the client."""
    mapped = _HTTP_ERRORS.get(error.status) if isinstance(error, TandemError) else None
    code: str | None
    if mapped is None:
        if isinstance(error, TandemError):
            logger.error("request failed with %s: %s", error.status, error)
        else:
            status_of(error)  # logs the traceback
        http_status, kind, code = _INTERNAL
        message, param = INTERNAL_ERROR_MESSAGE, None
    else:
        http_status, kind, default_code = mapped
        message, param = str(error), getattr(error, "param", None)
        code = getattr(error, "code", None) or default_code
    headers: dict[str, str] = {}
    retry_after_s = getattr(error, "retry_after_s", None)
    if http_status == 429 and isinstance(retry_after_s, int | float):
        headers["Retry-After"] = str(max(0, math.ceil(retry_after_s)))
    body = {"message": message, "type": kind, "param": param, "code": code}
    return http_status, {"error": body}, headers
