"""The public API as a plain class on domain types: `ApiRequest`s in, `ApiChunk`s out.

`TandemService` reads an `ApiRequest` (`cluster.api.request`) into the router's
`GenerationRequest` (`cluster.api.request_reader`: tokenization, validation and the context
limit), runs it on the router, and yields what comes back as `ApiChunk`s
(`cluster.api.response`): the router's chunks with the request id, and on the last one the
usage and speculation counters. It knows nothing of protobuf, gRPC servers, JSON or Ray: the
gRPC face (`cluster.api.grpc_api`, converting with `cluster.api.convert`; served by the Serve
ingress and `tests.cluster.grpc_front`) and the OpenAI-compatible API (`cluster.api.openai`,
JSON straight to domain types and back) are thin adapters over it, and tests call it
directly.

Deadlines: a caller's deadline (`Caller.deadline`, `cluster.api.caller`) bounds the queue wait
and every round, and reaches the replicas as time left; one already past when the request
arrives is DEADLINE_EXCEEDED at once, before it is admitted.

Tenants (`cluster.api.tenants`): every call is authenticated first (UNAUTHENTICATED), once, by
the face it came through (`authenticate`), before its request is even read; the service's
entry points take the tenant that returned. The request is then validated and checked against
what its tenant may ask (PERMISSION_DENIED). When
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
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from contextlib import closing
from typing import TYPE_CHECKING

from cluster.api.admission import Admission
from cluster.api.audit import Auditor, Served, audit_served, drafter_label
from cluster.api.audit_config import AuditConfig
from cluster.api.caller import ANONYMOUS_CALL, Caller
from cluster.api.online_audit import CLOSE_TIMEOUT_S, OnlineAudit
from cluster.api.request import ApiRequest
from cluster.api.request_reader import RequestReader
from cluster.api.response import ApiChunk, Usage, merge
from cluster.api.running import RunningRequests
from cluster.api.service_config import ServiceConfig
from cluster.api.stream_interval import StreamInterval
from cluster.api.tenants import Tenant, Tenants, TenantUsage
from cluster.metrics.recorder import TandemMetrics
from cluster.routing.request import (
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    SpeculationStats,
)
from cluster.routing.router import Router
from cluster.routing.waits import Wait, blocking
from cluster.runtime.errors import DeadlineExceededError, TandemError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class RequestCancelledError(TandemError):
    """The caller went away (cancelled, or past its deadline) before the request finished."""

    status = "CANCELLED"


def _new_request_id() -> str:
    return uuid.uuid4().hex


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
        self.config = config if config is not None else ServiceConfig()
        self.reader = RequestReader(tokenizer, self.config, max_context_tokens)
        """Reads requests into the router's (`cluster.api.request_reader`)."""
        self._router = router
        self.tenants = tenants
        self.metrics = metrics if metrics is not None else TandemMetrics()
        self.admission = Admission(
            self.config.max_running_requests,
            self.config.max_queued_requests,
            on_change=self.metrics.queue,
        )
        self.requests = RunningRequests()
        # The auditor is handed this service as its `ServicePort`, so that audit.py need not
        # import this module.
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

    @property
    def max_context_tokens(self) -> int | None:
        """The verifier replicas' context limit the reader checks requests against (None:
        not checked)."""
        return self.reader.max_context_tokens

    def authenticate(self, caller: Caller = ANONYMOUS_CALL) -> Tenant:
        """The caller's tenant (UNAUTHENTICATED for a missing or unknown key): what every face
        does first, once per call, before it reads the request."""
        return self.tenants.authenticate(caller.authorization)

    def generate(
        self,
        tenant: Tenant,
        message: ApiRequest,
        deadline: float | None = None,
        is_active: Callable[[], bool] | None = None,
    ) -> ApiChunk:
        """Run a request to completion: its whole stream merged into one chunk
        (`cluster.api.response.merge`), with the finish reason, usage and counters.

        `is_active`, when given, is asked after every verify pass; once it returns False the
        request stops, its sessions are freed, and `RequestCancelledError` is raised.
        """
        chunks: list[ApiChunk] = []
        with closing(self.stream(tenant, message, deadline)) as stream:
            for chunk in stream:
                chunks.append(chunk)
                if not chunk.finished and is_active is not None and not is_active():
                    raise RequestCancelledError("the request was cancelled by its caller")
        return merge(chunks)

    def stream(
        self,
        tenant: Tenant,
        message: ApiRequest,
        deadline: float | None = None,
        *,
        on_finished: Callable[[Served], None] | None = None,
    ) -> Generator[ApiChunk, None, None]:
        """Chunks as tokens are committed; the last one has finish reason, usage and stats.

        `tenant` is the caller's (`authenticate`); `deadline` its `time.monotonic()` instant,
        if any. The request is validated here, before the first chunk is asked for; limits
        that free up with time (the tenant's quotas, the router's queue) are checked when the
        first chunk is. Closing the returned generator early frees the request's sessions.
        `on_finished` is called with the request as served if it finishes normally (length or
        stop), before its last chunk is yielded (the audit's hook).
        """
        return blocking(self.stream_waits(tenant, message, deadline, on_finished=on_finished))

    def stream_waits(
        self,
        tenant: Tenant,
        message: ApiRequest,
        deadline: float | None = None,
        *,
        on_finished: Callable[[Served], None] | None = None,
    ) -> Generator[ApiChunk | Wait, None, None]:
        """`stream` as waits (`cluster.routing.waits`): the chunks, with a `Wait` wherever the
        request waits (in the router's queue, for a replica), for a driver that runs many
        requests without a thread each (the router replica's own gRPC server)."""
        request, pipelined = self.reader.to_request(message, deadline)
        with self._counting_refusal(tenant):
            self.tenants.check(tenant, request.max_tokens)
            if request.deadline is not None and time.monotonic() >= request.deadline:
                raise DeadlineExceededError(
                    "the request's deadline had passed when it arrived: nothing was run"
                )
        return self._admitted(tenant, request, pipelined, _new_request_id(), on_finished)

    def cancel(self, tenant: Tenant, request_id: str) -> None:
        """Cancel one of the tenant's running requests (NOT_FOUND for anyone else's)."""
        self.requests.cancel(request_id, tenant.name)

    def usage(self, tenant: Tenant) -> TenantUsage:
        """The tenant's own usage counters."""
        return self.tenants.usage(tenant)

    def _admitted(
        self,
        tenant: Tenant,
        request: GenerationRequest,
        pipelined: bool,
        request_id: str,
        on_finished: Callable[[Served], None] | None,
    ) -> Generator[ApiChunk | Wait, None, None]:
        """The request's chunks once its tenant's limits and the router's queue let it run."""
        with self._counting_refusal(tenant):
            self.tenants.start(tenant)
        try:
            try:
                yield from self.admission.entering(
                    tenant.name, tenant.config.weight, request.deadline
                )
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
    ) -> Generator[ApiChunk | Wait, None, None]:
        stats = SpeculationStats()
        # Whose text may draft for it, and whether its text may be held for drafting at all.
        request = dataclasses.replace(
            request, tenant=tenant.name, suffix_index=tenant.config.suffix_index
        )
        chunks = self._router.stream_waits(request, stats, pipelined=pipelined)
        interval = StreamInterval(
            self.config.stream_interval_tokens, self.config.stream_interval_ms
        )
        num_generated = 0
        served: list[int] | None = [] if on_finished or self.online_audit.enabled else None
        outcome = FinishReason.CANCELLED.value  # unless it finishes or fails: the caller left
        try:
            for chunk in chunks:
                if isinstance(chunk, Wait):
                    yield chunk
                    continue
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
                out = interval.offer(_api_chunk(chunk, request, request_id, stats, num_generated))
                if out is not None:
                    yield out
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


def _api_chunk(
    chunk: GenerationChunk,
    request: GenerationRequest,
    request_id: str,
    stats: SpeculationStats,
    num_generated: int,
) -> ApiChunk:
    """The router's chunk as the API sends it: the last one with usage and counters."""
    if chunk.finish_reason is None:
        return ApiChunk(request_id, chunk.tokens, chunk.text)
    usage = Usage(prompt_tokens=len(request.prompt_tokens), completion_tokens=num_generated)
    return ApiChunk(request_id, chunk.tokens, chunk.text, chunk.finish_reason, usage, stats)


def _close(chunks: Iterator[GenerationChunk | Wait]) -> None:
    # `Router.stream` is typed as an Iterator but is a generator, and closing it is what frees
    # the sessions; an iterator that is not a generator holds nothing to free.
    if isinstance(chunks, Generator):
        chunks.close()
