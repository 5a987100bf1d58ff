"""The public API as a plain class: `tandem.v1.Tandem` requests in, responses and chunks out.

`TandemService` turns a `GenerateRequest` into the router's `GenerationRequest` (a text prompt
is tokenized with the target's tokenizer, `add_special_tokens=False`, so the ids are exactly
the text's; chat messages are rendered by the target's chat template first, `cluster.api.chat`,
and their text tokenized the same way), runs it on the router, and turns what comes back into
`GenerateResponse` / `GenerateChunk` messages. It knows nothing of gRPC servers or Ray:
`tests.cluster.grpc_front`, the Serve ingress and the OpenAI-compatible API
(`cluster.api.openai`) are thin adapters over it, and tests call it directly.

Validation: every bad field raises `InvalidArgumentError` (INVALID_ARGUMENT) naming the field.
Proto3 cannot tell a plain scalar's 0 from unset, so `max_tokens` 0 is an error like any value
below 1, never a silent default. `max_tokens` above `ServiceConfig.max_tokens_limit` is
INVALID_ARGUMENT too, not RESOURCE_EXHAUSTED: the limit is fixed configuration, so the same
request can never succeed on this server, while RESOURCE_EXHAUSTED tells a client to back off
and retry. Unset optional fields take defaults: `top_p` 1.0 (no nucleus cut), `seed` a fresh
random one (as generate.proto promises; send a seed to make sampling repeatable),
`draft_tokens` and `pipelined` from `ServiceConfig`, `skip_special_tokens` true. Prompt token
ids are checked against the vocabulary by the verifier when the request starts;
`stop_token_ids` against the tokenizer's here (`check_stop_token_ids`). `ignore_eos`,
`min_tokens` (at most `max_tokens`) and `stop_token_ids` reach the router as they are: how
each ends a generation is `cluster.routing.router`'s.

Context limit: given the verifier replicas' `max_context_tokens` (the Serve ingress passes
`TandemConfig.verifier_limits`), a request whose prompt plus `max_tokens` exceeds it is
INVALID_ARGUMENT before anything runs, naming the limit and the largest `max_tokens` that
fits: the router keeps every pass within prompt plus `max_tokens`, so a request admitted never
meets the limit mid-stream, and one refused could never have finished. A drafter with a
smaller context only stops drafting when it is full (`cluster.routing.router`).

Deadlines: a caller's deadline (`Caller.deadline`) bounds the queue wait and every round, and
reaches the replicas as time left; one already past when the request arrives is
DEADLINE_EXCEEDED at once, before it is admitted.

Tenants (`cluster.api.tenants`): every call is authenticated first (UNAUTHENTICATED), then the
request is validated and checked against what its tenant may ask (PERMISSION_DENIED). When
the first chunk is asked for, the tenant's concurrency and token-rate quotas and the router's
bounded queue (`cluster.api.admission`) admit it or refuse it (RESOURCE_EXHAUSTED, with when to
retry); it may wait in the queue until its deadline. The tenant's usage counters grow as
tokens are committed. Metrics (`cluster.metrics`): a request's counters are recorded when it
ends, by tenant and outcome; a refusal by tenant and status; the queue's depth as it changes.

Audit (`cluster.api.audit`, `cluster.api.online_audit`): `audit` runs a greedy or seed-exact
request like `generate`, then replays it through the plain target and compares token by token;
with `AuditConfig.fraction` above 0, that share of the requests that finish normally is audited
in the background (`close` stops that worker).

Every request gets a fresh request id (uuid4 hex) on its response and on every chunk; its
tenant, and only its tenant, can cancel it by that id (`cancel`): its stream then ends with
FINISH_REASON_CANCELLED after the round in flight. The last chunk of a stream carries the
finish reason, usage and speculation counters. Closing a stream
early (the client went away) closes the router's stream, which frees the request's sessions on
both replicas; `generate` stops the same way once its `is_active` callback returns False.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster.api.admission import Admission
from cluster.api.audit import Auditor, Served, audit_served, drafter_label
from cluster.api.chat import render_chat
from cluster.api.convert import finish_reason_to_proto, stats_to_proto
from cluster.api.online_audit import CLOSE_TIMEOUT_S, AuditConfig, OnlineAudit
from cluster.api.running import RunningRequests
from cluster.api.sampling_rule import AUTO, check_rule_name, resolve_seed_exact
from cluster.api.tenants import Tenant, Tenants
from cluster.metrics import TandemMetrics
from cluster.replica.wire import grammar_from_wire, sampling_from_wire
from cluster.routing.request import (
    DEFAULT_DRAFT_TOKENS,
    MAX_DRAFT_TOKENS,
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    SpeculationStats,
)
from cluster.routing.router import Router
from cluster.runtime.constraint import Grammar, check_grammar, grammar_tokenizer_of
from cluster.runtime.errors import DeadlineExceededError, InvalidArgumentError, TandemError
from cluster.runtime.session import DEFAULT_MAX_CONTEXT_TOKENS
from protos import generate_pb2, sampling_pb2

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_MAX_TOKENS_LIMIT = DEFAULT_MAX_CONTEXT_TOKENS
"""Default ceiling on `max_tokens`: the verifier's default context."""
DEFAULT_MAX_RUNNING = 64
DEFAULT_MAX_QUEUED = 128
"""Together within the Serve ingress's 256 request threads: a queued request holds one."""


@dataclass(frozen=True)
class ServiceConfig:
    """Server-side defaults and limits of the public API."""

    default_draft_tokens: int = DEFAULT_DRAFT_TOKENS
    """Draft block length of a request that sets none; 0 means no speculation."""
    default_pipelined: bool = True
    """Whether a request that does not say drafts the next block during verification."""
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT
    """Largest `max_tokens` a request may ask for."""
    max_running_requests: int = DEFAULT_MAX_RUNNING
    """Requests one router replica generates at once; more wait in its queue."""
    max_queued_requests: int = DEFAULT_MAX_QUEUED
    """Requests that may wait; beyond them a request is refused (RESOURCE_EXHAUSTED)."""
    sampling_rule: str = AUTO
    """The rule of a sampled request that names none (`cluster.api.sampling_rule`): `auto`
    (seed-exact when the request carries a seed, rejection sampling otherwise), `seed_exact`
    or `rejection`."""

    def __post_init__(self) -> None:
        check_rule_name(self.sampling_rule, "sampling_rule")
        if not 0 <= self.default_draft_tokens <= MAX_DRAFT_TOKENS:
            raise InvalidArgumentError(
                f"default_draft_tokens must be in 0..{MAX_DRAFT_TOKENS}, "
                f"got {self.default_draft_tokens}"
            )
        if self.max_tokens_limit < 1:
            raise InvalidArgumentError(
                f"max_tokens_limit must be >= 1, got {self.max_tokens_limit}"
            )
        if self.max_running_requests < 1 or self.max_queued_requests < 0:
            raise InvalidArgumentError(
                "max_running_requests must be >= 1 and max_queued_requests >= 0, got "
                f"{self.max_running_requests} and {self.max_queued_requests}"
            )


class RequestCancelledError(TandemError):
    """The caller went away (cancelled, or past its deadline) before the request finished."""

    status = "CANCELLED"


def _new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Caller:
    """Who sent a call, and until when it may run: what the gRPC adapters read off the call."""

    authorization: str | None = None
    """The `authorization` metadata ("Bearer <key>"), if sent."""
    deadline: float | None = None
    """The client's deadline as a `time.monotonic()` instant, if it set one."""


ANONYMOUS_CALL = Caller()
"""A call with no metadata and no deadline (in-process callers, tests)."""


class TandemService:
    """Serves the public API on one router, for the tenants of `tenants`."""

    def __init__(
        self,
        router: Router,
        tokenizer: PreTrainedTokenizerBase,
        config: ServiceConfig | None = None,
        *,
        tenants: Tenants,
        metrics: TandemMetrics | None = None,
        max_context_tokens: int | None = None,
        audit: AuditConfig | None = None,
    ) -> None:
        """`tenants`: who may call and their limits; `Tenants.unauthenticated()` lets every
        call in as one anonymous tenant (local development only). `metrics`: where each
        request's counters go when it ends (default: Ray's metrics, if in a Ray worker).
        `max_context_tokens`: the verifier replicas' context limit, which prompt plus
        `max_tokens` may not exceed (None: not checked here; a verifier then refuses the
        request only when its context is full, mid-stream). `audit`: the online audit
        (`cluster.api.online_audit`; None: off); `close` stops its worker."""
        if max_context_tokens is not None and max_context_tokens < 1:
            raise InvalidArgumentError(f"max_context_tokens must be >= 1, got {max_context_tokens}")
        self.max_context_tokens = max_context_tokens
        self._router = router
        self._tokenizer = tokenizer
        self.config = config if config is not None else ServiceConfig()
        self.tenants = tenants
        eos = tokenizer.eos_token_id
        self._grammar_tokenizer = grammar_tokenizer_of(tokenizer, [] if eos is None else [eos])
        self.metrics = metrics if metrics is not None else TandemMetrics()
        self.admission = Admission(
            self.config.max_running_requests,
            self.config.max_queued_requests,
            on_change=self.metrics.queue,
        )
        self.requests = RunningRequests()
        self.auditor = Auditor(self, router)
        """The audit API (`audit`, `POST /v1/audit`)."""
        audit = audit if audit is not None else AuditConfig()
        self.online_audit = OnlineAudit(
            audit, lambda served: audit_served(router, served, audit.dtype), self.metrics
        )

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the online audit's worker, waiting up to `timeout_s` for an audit in flight
        (the router is the caller's to close)."""
        self.online_audit.close(timeout_s)

    def grammar(self, message: sampling_pb2.Grammar) -> Grammar | None:
        """The request's grammar, checked to compile for the target's tokenizer (an
        InvalidArgumentError naming `grammar.<kind>` before any work otherwise)."""
        grammar = grammar_from_wire(message)
        if grammar is not None:
            check_grammar(grammar, self._grammar_tokenizer())
        return grammar

    def to_request(
        self, message: generate_pb2.GenerateRequest, deadline: float | None = None
    ) -> tuple[GenerationRequest, bool]:
        """The router's request for `message`, and whether to pipeline it; validated."""
        max_tokens = message.max_tokens
        if max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens must be >= 1, got {max_tokens}")
        if max_tokens > self.config.max_tokens_limit:
            raise InvalidArgumentError(
                f"max_tokens must be <= {self.config.max_tokens_limit} on this server, "
                f"got {max_tokens}"
            )
        seeded = message.HasField("seed")
        sampling = dataclasses.replace(
            sampling_from_wire(message.sampling),
            seed_exact=resolve_seed_exact(message.sampling.rule, seeded, self.config.sampling_rule),
        )
        speculation = message.speculation
        prompt_tokens = self.prompt_tokens(message)
        if self.max_context_tokens is not None:
            check_context(len(prompt_tokens), max_tokens, self.max_context_tokens)
        request = GenerationRequest(
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            sampling=sampling,
            seed=message.seed if seeded else secrets.randbits(64),
            stop=tuple(message.stop),
            draft_tokens=(
                speculation.draft_tokens
                if speculation.HasField("draft_tokens")
                else self.config.default_draft_tokens
            ),
            deadline=deadline,
            grammar=self.grammar(message.grammar),
            min_tokens=message.min_tokens,
            stop_token_ids=self.check_stop_token_ids(message.stop_token_ids),
            ignore_eos=message.ignore_eos,
            skip_special_tokens=(
                message.skip_special_tokens if message.HasField("skip_special_tokens") else True
            ),
        )
        pipelined = (
            speculation.pipelined
            if speculation.HasField("pipelined")
            else self.config.default_pipelined
        )
        return request, pipelined

    def generate(
        self,
        message: generate_pb2.GenerateRequest,
        is_active: Callable[[], bool] | None = None,
        caller: Caller = ANONYMOUS_CALL,
    ) -> generate_pb2.GenerateResponse:
        """Run a request to completion.

        `is_active`, when given, is asked after every verify pass; once it returns False the
        request stops, its sessions are freed, and `RequestCancelledError` is raised.
        """
        response = generate_pb2.GenerateResponse()
        text: list[str] = []
        with closing(self.stream(message, caller)) as chunks:
            for chunk in chunks:
                response.request_id = chunk.request_id
                response.token_ids.extend(chunk.token_ids)
                text.append(chunk.text)
                if chunk.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
                    response.finish_reason = chunk.finish_reason
                    response.usage.CopyFrom(chunk.usage)
                    response.speculation.CopyFrom(chunk.speculation)
                elif is_active is not None and not is_active():
                    raise RequestCancelledError("the request was cancelled by its caller")
        response.text = "".join(text)
        return response

    def stream(
        self,
        message: generate_pb2.GenerateRequest,
        caller: Caller = ANONYMOUS_CALL,
        *,
        on_finished: Callable[[Served], None] | None = None,
    ) -> Generator[generate_pb2.GenerateChunk, None, None]:
        """Chunks as tokens are committed; the last one has finish reason, usage and stats.

        The caller is authenticated and the request validated here, before the first chunk is
        asked for; limits that free up with time (the tenant's quotas, the router's queue) are
        checked when the first chunk is. Closing the returned generator early frees the
        request's sessions. `on_finished` is called with the request as served if it finishes
        normally (length or stop), before its last chunk is yielded (the audit's hook).
        """
        tenant = self.tenants.authenticate(caller.authorization)
        request, pipelined = self.to_request(message, caller.deadline)
        with self._counting_refusal(tenant):
            self.tenants.check(tenant, request.max_tokens)
            if request.deadline is not None and time.monotonic() >= request.deadline:
                raise DeadlineExceededError(
                    "the request's deadline had passed when it arrived: nothing was run"
                )
        return self._admitted(tenant, request, pipelined, _new_request_id(), on_finished)

    def audit(
        self,
        message: generate_pb2.AuditRequest,
        caller: Caller = ANONYMOUS_CALL,
        is_active: Callable[[], bool] | None = None,
    ) -> generate_pb2.AuditResponse:
        """Run a greedy or seed-exact request to completion, replay it through the plain
        target and compare token by token (`cluster.api.audit`); `is_active` as for
        `generate`."""
        return self.auditor.audit(message, caller, is_active)

    def cancel(self, message: generate_pb2.CancelRequest, caller: Caller = ANONYMOUS_CALL) -> None:
        """Cancel one of the caller's running requests (NOT_FOUND for anyone else's)."""
        tenant = self.tenants.authenticate(caller.authorization)
        self.requests.cancel(message.request_id, tenant.name)

    def usage(self, caller: Caller = ANONYMOUS_CALL) -> generate_pb2.TenantUsage:
        """The caller's own usage counters."""
        tenant = self.tenants.authenticate(caller.authorization)
        return generate_pb2.TenantUsage(tenant=tenant.name, **vars(self.tenants.usage(tenant)))

    def check_stop_token_ids(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        """`token_ids` as a tuple, each checked to be a token of the target's tokenizer."""
        vocab_size = len(self._tokenizer)
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgumentError(
                f"stop_token_ids must be token ids in 0..{vocab_size - 1} (the tokenizer's "
                f"vocabulary), got {bad[0]}"
            )
        return tuple(token_ids)

    def chat_prompt(
        self, messages: Sequence[tuple[str, str]], tools: Sequence[Mapping[str, Any]] = ()
    ) -> str:
        """The prompt text the target's chat template makes of (role, content) `messages` and
        function `tools`, ending with the assistant's turn open (`cluster.api.chat`)."""
        return render_chat(self._tokenizer, messages, tools)

    def prompt_tokens(self, message: generate_pb2.GenerateRequest) -> tuple[int, ...]:
        """The prompt of `message` as token ids: text and rendered chat messages are tokenized
        with `add_special_tokens=False`, token ids are taken as given; validated."""
        which = message.WhichOneof("prompt")
        if which == "text":
            if message.text == "":
                raise InvalidArgumentError("prompt text must not be empty")
            return self._encode(message.text, "prompt text")
        if which == "token_ids":
            if not message.token_ids.ids:
                raise InvalidArgumentError("prompt token_ids must not be empty")
            return tuple(message.token_ids.ids)
        if which == "chat":
            messages = [(m.role, m.content) for m in message.chat.messages]
            return self._encode(self.chat_prompt(messages), "chat prompt")
        raise InvalidArgumentError("prompt is missing: set text or token_ids, or chat")

    def _encode(self, text: str, what: str) -> tuple[int, ...]:
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise InvalidArgumentError(f"{what} encodes to no tokens")
        return tuple(int(token) for token in ids)

    def _admitted(
        self,
        tenant: Tenant,
        request: GenerationRequest,
        pipelined: bool,
        request_id: str,
        on_finished: Callable[[Served], None] | None,
    ) -> Generator[generate_pb2.GenerateChunk, None, None]:
        """The request's chunks once its tenant's limits and the router's queue let it run."""
        with self._counting_refusal(tenant):
            self.tenants.start(tenant)
        try:
            try:
                self.admission.enter(tenant.name, tenant.config.weight, request.deadline)
            except TandemError as error:
                self.tenants.refused(tenant)
                self.metrics.request_refused(tenant.name, error.status)
                raise
            try:
                with self.requests.running(request_id, tenant.name) as cancelled:
                    self.tenants.charge(tenant, prompt=len(request.prompt_tokens))
                    yield from self._chunks(
                        tenant, request, pipelined, request_id, cancelled, on_finished
                    )
            finally:
                self.admission.leave(tenant.name)
        finally:
            self.tenants.finish(tenant)

    def _chunks(
        self,
        tenant: Tenant,
        request: GenerationRequest,
        pipelined: bool,
        request_id: str,
        cancelled: threading.Event,
        on_finished: Callable[[Served], None] | None,
    ) -> Generator[generate_pb2.GenerateChunk, None, None]:
        stats = SpeculationStats()
        chunks = self._router.stream(request, stats, pipelined=pipelined)
        num_generated = 0
        served: list[int] | None = [] if on_finished or self.online_audit.enabled else None
        outcome = FinishReason.CANCELLED.value  # unless it finishes or fails: the caller left
        try:
            for chunk in chunks:
                num_generated += len(chunk.tokens)
                self.tenants.charge(tenant, generated=len(chunk.tokens))
                if cancelled.is_set() and chunk.finish_reason is None:
                    chunk = dataclasses.replace(chunk, finish_reason=FinishReason.CANCELLED)
                if chunk.finish_reason is not None:
                    outcome = chunk.finish_reason.value
                if served is not None:
                    served.extend(chunk.tokens)
                    if chunk.finish_reason not in (None, FinishReason.CANCELLED):
                        self._finished(
                            Served(request_id, request, tuple(served), drafter_label(stats)),
                            on_finished,
                        )
                yield self._chunk_to_proto(chunk, request, request_id, stats, num_generated)
                if chunk.finish_reason is not None:
                    return
        except Exception as error:
            outcome = (error.status if isinstance(error, TandemError) else "INTERNAL").lower()
            raise
        finally:
            _close(chunks)
            self.tenants.charge(tenant, drafted=stats.num_drafted, accepted=stats.num_accepted)
            self.metrics.request_ended(
                tenant.name, outcome, stats, len(request.prompt_tokens), num_generated
            )

    def _finished(self, served: Served, on_finished: Callable[[Served], None] | None) -> None:
        """A request finished normally: tell the caller who asked, offer it to the online
        audit."""
        if on_finished is not None:
            on_finished(served)
        self.online_audit.offer(served)

    @contextlib.contextmanager
    def _counting_refusal(self, tenant: Tenant) -> Iterator[None]:
        """Count a refusal (a limit's error) in the metrics, by its status."""
        try:
            yield
        except TandemError as error:
            self.metrics.request_refused(tenant.name, error.status)
            raise

    @staticmethod
    def _chunk_to_proto(
        chunk: GenerationChunk,
        request: GenerationRequest,
        request_id: str,
        stats: SpeculationStats,
        num_generated: int,
    ) -> generate_pb2.GenerateChunk:
        message = generate_pb2.GenerateChunk(
            request_id=request_id, token_ids=chunk.tokens, text=chunk.text
        )
        if chunk.finish_reason is not None:
            message.finish_reason = finish_reason_to_proto(chunk.finish_reason)
            message.usage.prompt_tokens = len(request.prompt_tokens)
            message.usage.completion_tokens = num_generated
            message.speculation.CopyFrom(stats_to_proto(stats))
        return message


def check_context(num_prompt_tokens: int, max_tokens: int, max_context_tokens: int) -> None:
    """Raise `InvalidArgumentError` unless the prompt plus `max_tokens` fits the context."""
    if num_prompt_tokens + max_tokens <= max_context_tokens:
        return
    exceeds = (
        f"prompt of {num_prompt_tokens} tokens plus max_tokens {max_tokens} exceeds the context "
        f"limit of {max_context_tokens} tokens"
    )
    if num_prompt_tokens >= max_context_tokens:
        raise InvalidArgumentError(
            f"{exceeds}; the prompt alone fills it: shorten the prompt so that prompt plus "
            f"max_tokens is at most {max_context_tokens}"
        )
    raise InvalidArgumentError(
        f"{exceeds}; lower max_tokens to at most {max_context_tokens - num_prompt_tokens}"
    )


def _close(chunks: Iterator[GenerationChunk]) -> None:
    # `Router.stream` is typed as an Iterator but is a generator, and closing it is what frees
    # the sessions; an iterator that is not a generator holds nothing to free.
    if isinstance(chunks, Generator):
        chunks.close()
