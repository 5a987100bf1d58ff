"""The OpenAI-compatible API as a plain class: JSON bodies in, OpenAI's response shapes out.

`OpenAIService` serves `GET /v1/models`, `POST /v1/completions` and `POST /v1/chat/completions`
(and Tandem's own `POST /v1/audit`, through `cluster.api.audit`) over a `TandemService`,
with no HTTP and no Ray: an HTTP adapter parses the JSON, passes the body and the caller (API
key, deadline) here, and frames what comes back. Every call is
authenticated first, like the gRPC API; the body is then checked field by field
(`cluster.api.openai_schema`: unsupported and unknown fields are errors naming the field,
`cluster.api.openai_errors`).

The body goes straight to the service's domain request (`cluster.api.request.ApiRequest`), and
its chunks (`cluster.api.response.ApiChunk`) straight to OpenAI's shapes: no protobuf on this
path. The caller is authenticated once, first (`TandemService.authenticate`), and the service
is handed its tenant. A completion's prompt is tokenized like a text prompt; chat messages are
rendered by the target's chat template (`cluster.api.chat`), as the gRPC API's `chat` prompt
is. The output is the Tandem request's, token for token: greedy
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
with `finish_reason` last (`cluster.api.openai_stream`; a face may merge the service's pending
chunks first, `open_stream`); with `stream_options.include_usage`, every chunk has `usage: null`
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
from cluster.api.caller import ANONYMOUS_CALL, Caller
from cluster.api.openai_errors import ModelNotFoundError, OpenAIError
from cluster.api.openai_schema import (
    OpenAIRequest,
    Route,
    body_object,
    parse_request,
    parse_stream,
)
from cluster.api.openai_stream import (
    OPENAI_FINISH_REASONS,
    ChunkBodies,
    head,
    usage_body,
)
from cluster.api.openai_structured import Structured, parse_structured, tool_message
from cluster.api.request import ApiRequest, Chat, Prompt
from cluster.api.request_reader import check_context
from cluster.api.response import ApiChunk
from cluster.api.status import INTERNAL_ERROR_MESSAGE, status_of
from cluster.api.tool_format import ToolFormat
from cluster.api.tool_formats import choose_format
from cluster.routing.waits import Wait, blocking
from cluster.runtime.errors import InvalidArgumentError, TandemError
from cluster.runtime.sampling_params import SamplingParams
from verifier.config import OWN_DTYPE, check_reference_dtype

if TYPE_CHECKING:
    from cluster.api.service import TandemService
    from cluster.api.tenants import Tenant

__all__ = [
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

    def authenticate(self, caller: Caller) -> None:
        """Raises UNAUTHENTICATED for a missing or unknown key: what the HTTP face asks before
        it reads a request's body."""
        self.service.authenticate(caller)

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
        tenant, _, message, structured = self._prepare(route, body, caller)
        response = self.service.generate(tenant, message, caller.deadline, is_active)
        text = response.text
        assert response.finish_reason is not None  # a whole stream ends with its reason
        reason = OPENAI_FINISH_REASONS[response.finish_reason]
        choice: dict[str, Any] = (
            {"index": 0, "text": text}
            if route == "completions"
            else {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None}}
        )
        if structured.calling is not None:
            choice["message"], reason = tool_message(structured.calling, text, reason)
        choice |= {"logprobs": None, "finish_reason": reason}
        assert response.usage is not None and response.stats is not None
        return {
            **head(route, _OBJECTS[route], response.request_id, created, self.model_name),
            "choices": [choice],
            "usage": usage_body(response.usage, response.stats),
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
        tenant, _, message, _ = self._prepare("completions", fields, caller)
        audited = self.service.auditor.run(
            tenant, message, dtype, caller.deadline, is_active, HTTP_FIELDS
        )
        return audit_json(audited)

    def stream(
        self, route: Route, body: object, caller: Caller = ANONYMOUS_CALL
    ) -> Generator[dict[str, Any], None, None]:
        """Chunk bodies in order; errors before the first chunk are raised by the first
        `next()`. Closing the generator early ends the Tandem request."""
        steps, bodies = self.open_stream(route, body, caller)
        with closing(blocking(steps)) as chunks:
            for chunk in chunks:
                yield from bodies.bodies(chunk)

    def open_stream(
        self, route: Route, body: object, caller: Caller = ANONYMOUS_CALL
    ) -> tuple[Generator[ApiChunk | Wait, None, None], ChunkBodies]:
        """The service's stream of domain chunks for `body` as waits
        (`TandemService.stream_waits`), and what turns each chunk into chunk bodies, for a face
        that merges pending chunks before it converts them (`cluster.serve.http`).
        Authenticates, checks and validates at once; closing the stream ends the Tandem
        request."""
        created = int(time.time())
        tenant, request, message, structured = self._prepare(route, body, caller)
        assert isinstance(message.prompt, tuple)  # `_prepare` tokenized it
        bodies = ChunkBodies(
            route, request, structured, len(message.prompt), self.model_name, created
        )
        return self.service.stream_waits(tenant, message, caller.deadline), bodies

    def to_api_request(
        self, route: Route, body: object, caller: Caller = ANONYMOUS_CALL
    ) -> tuple[OpenAIRequest, ApiRequest]:
        """The checked body and the Tandem request it asks for (the prompt as token ids)."""
        _, request, message, _ = self._prepare(route, body, caller)
        return request, message

    def _prepare(
        self, route: Route, body: object, caller: Caller
    ) -> tuple[Tenant, OpenAIRequest, ApiRequest, Structured]:
        """The caller's tenant (authenticated first, and only here), `to_api_request`'s, and
        the constraint or tool call the body asks for."""
        tenant = self.service.authenticate(caller)
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
        stop_token_ids = self._stop_token_ids(request)
        if structured.grammar is not None:
            try:
                self.service.reader.grammar(structured.grammar)
            except InvalidArgumentError as error:
                raise OpenAIError(str(error), structured.source_field) from error
        message = ApiRequest(
            prompt=prompt_tokens,
            max_tokens=max_tokens,
            sampling=SamplingParams(
                temperature=request.temperature, top_p=request.top_p, top_k=request.top_k
            ),
            rule=request.sampling_rule,
            seed=request.seed,
            stop=request.stop,
            draft_tokens=request.draft_tokens,
            pipelined=request.pipelined,
            grammar=structured.grammar,
            min_tokens=request.min_tokens,
            stop_token_ids=stop_token_ids,
            ignore_eos=request.ignore_eos,
            skip_special_tokens=request.skip_special_tokens,
        )
        return tenant, request, message, structured

    def _stop_token_ids(self, request: OpenAIRequest) -> tuple[int, ...]:
        try:
            return self.service.reader.check_stop_token_ids(request.stop_token_ids)
        except InvalidArgumentError as error:
            raise OpenAIError(str(error), "stop_token_ids") from error

    def _prompt_tokens(self, request: OpenAIRequest, structured: Structured) -> tuple[int, ...]:
        prompt: Prompt
        if isinstance(request.prompt, str):
            prompt = request.prompt
        elif structured.tools or request.has_tool_turns:
            try:  # tools, calls and their results go into the prompt through the chat template
                prompt = self.service.reader.chat_prompt(request.conversation, structured.tools)
            except InvalidArgumentError as error:
                raise OpenAIError(
                    str(error), "tools" if structured.tools else "messages"
                ) from error
        elif request.prompt is not None:
            prompt = request.prompt
        else:
            prompt = Chat(request.messages)
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
