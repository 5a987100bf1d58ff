"""The audit API: run a request as Generate does, replay it through the plain target, compare.

Greedy and seed-exact requests produce output that is a function of (prompt, seed, settings,
target model) alone (`cluster.runtime.gumbel`), so a served request can be replayed through the
target with no drafter and no batching (`VerifierPort.reference`, on a verifier the router's
pool picks) and compared token by token (`cluster.runtime.audit.compare`). `Auditor` is what
gRPC `Tandem.Audit` (`cluster.api.grpc_api.GrpcApi.audit`) and `POST /v1/audit`
(`OpenAIService.audit`) delegate to, with the caller's tenant (each face authenticates the
caller once, before anything else) and the request in domain terms (`ApiRequest`):

1. validate the request exactly as Generate does;
2. refuse, before anything runs, a sampled request the rejection rule would serve
   (`NotReplayableError`, INVALID_ARGUMENT naming the field to change: its tokens depend on how
   it was drafted, so no replay can match them token by token); a seed-exact request that sent
   no seed runs with one picked here, so that the replay knows it;
3. run it to completion through the normal path (tenants, quotas, queue, metrics);
4. ask a verifier for the reference, in the request's deadline, in the weights asked for (""
   the verifier's own, "float32" a float32 copy of the target);
5. report: matched / total, the first diverging position, the target's top-2 gap there, the
   served and reference tokens, which rule and drafter served it, the replay's dtype, and the
   cause (`cluster.runtime.audit.cause`).

A request cancelled before it finished has nothing to audit: CANCELLED.

Dependencies: the service builds its `Auditor` and hands itself in as a `ServicePort`, and the
OpenAI-compatible API calls the auditor, so this module imports neither `cluster.api.service`
nor `cluster.api.openai`; both import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from contextlib import closing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from cluster.api.request import ApiRequest
from cluster.api.request_reader import RequestReader
from cluster.api.response import ApiChunk
from cluster.api.sampling_rule import REJECTION
from cluster.api.sampling_rule import SEED_EXACT as SEED_EXACT_RULE
from cluster.routing.request import GenerationRequest, SpeculationStats
from cluster.runtime.audit import AuditReport, compare, report_json
from cluster.runtime.errors import CancelledError, InvalidArgumentError
from cluster.runtime.sampling_params import SamplingParams
from verifier.config import OWN_DTYPE, check_reference_dtype

if TYPE_CHECKING:
    from cluster.api.tenants import Tenant
    from cluster.routing.router import Router

GREEDY = "greedy"
SEED_EXACT = "seed_exact"
NO_DRAFTER = "none"
PROMPT_LOOKUP = "prompt_lookup"


class NotReplayableError(InvalidArgumentError):
    """A sampled request the rejection rule serves: its tokens depend on how it was drafted, so
    it cannot be audited token by token. `param` names the field to change."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (str(self), self.param))


@dataclass(frozen=True)
class Fields:
    """How an API names a request's fields, for errors."""

    seed: str
    rule: str
    temperature: str


GRPC_FIELDS = Fields("request.seed", "request.sampling.rule", "request.sampling.temperature")
HTTP_FIELDS = Fields("seed", "sampling_rule", "temperature")


@dataclass(frozen=True)
class Served:
    """A request that finished normally (length or stop), as the service served it."""

    request_id: str
    request: GenerationRequest
    """What ran: the prompt's token ids, the sampling settings (rule resolved), the seed."""
    tokens: tuple[int, ...]
    """The tokens sent to the client."""
    drafter: str
    """Which drafter served it (`drafter_label`)."""


@dataclass(frozen=True)
class Audited:
    """A served request and its audit."""

    served: Served
    report: AuditReport


def replay_rule(sampling: SamplingParams) -> str | None:
    """The rule a replay reproduces, "greedy" or "seed_exact"; None for a rejection-rule
    sampled request, which no replay can reproduce token by token."""
    if sampling.is_greedy:
        return GREEDY
    return SEED_EXACT if sampling.seed_exact else None


def drafter_label(stats: SpeculationStats) -> str:
    """The drafter replicas that drafted for a request, joined by ","; "prompt_lookup" when
    only prompt lookup proposed blocks; "none" when nothing was drafted (the target alone)."""
    if stats.drafters:
        return ",".join(stats.drafters)
    return PROMPT_LOOKUP if stats.num_drafted else NO_DRAFTER


def audit_served(router: Router, served: Served, dtype: str = OWN_DTYPE) -> AuditReport:
    """`served` replayed on a verifier of `router`'s pool in `dtype`'s weights, compared token
    by token. InvalidArgumentError for a request `replay_rule` cannot replay."""
    rule = replay_rule(served.request.sampling)
    if rule is None:
        raise InvalidArgumentError(
            f"request {served.request_id} was sampled by the rejection rule: not replayable"
        )
    replay = router.reference(served.request, served.tokens, dtype)
    return compare(served.tokens, replay, rule, served.drafter)


def audit_json(audited: Audited) -> dict[str, Any]:
    """The body `POST /v1/audit` answers: the request id, the served token ids, and the
    report's fields (`cluster.runtime.audit.report_json`: with `ok` and `cause`; an infinite gap
    as the string "inf")."""
    return {
        "object": "audit",
        "request_id": audited.served.request_id,
        "token_ids": list(audited.served.tokens),
        **report_json(audited.report),
    }


class ServicePort(Protocol):
    """What `Auditor` needs of the service it audits on: `cluster.api.service.TandemService`,
    which builds the auditor and passes itself in (module docstring)."""

    @property
    def reader(self) -> RequestReader:
        """Validates a request exactly as Generate does."""
        ...

    def stream(
        self,
        tenant: Tenant,
        message: ApiRequest,
        deadline: float | None = None,
        *,
        on_finished: Callable[[Served], None] | None = None,
    ) -> Generator[ApiChunk, None, None]:
        """Runs a request through the normal path; `on_finished` gets it as served."""
        ...


class Auditor:
    """Audits requests on one service and router (see the module docstring)."""

    def __init__(self, service: ServicePort, router: Router) -> None:
        self._service = service
        self._router = router

    def run(
        self,
        tenant: Tenant,
        message: ApiRequest,
        dtype: str = OWN_DTYPE,
        deadline: float | None = None,
        is_active: Callable[[], bool] | None = None,
        fields: Fields = GRPC_FIELDS,
    ) -> Audited:
        """Run `message` for `tenant` (authenticated by the caller's face) to completion,
        then audit it in `dtype`'s weights (module docstring). `is_active` returning False
        stops the request (CANCELLED); `fields` names the fields in errors."""
        dtype = check_reference_dtype(dtype, "dtype")
        request = self.replayable(message, fields)
        finished: list[Served] = []
        stream = self._service.stream(tenant, request, deadline, on_finished=finished.append)
        with closing(stream) as chunks:
            for chunk in chunks:
                if not chunk.finished and is_active is not None and not is_active():
                    raise CancelledError("the audit was cancelled by its caller")
        if not finished:
            raise CancelledError("the request was cancelled before it finished: nothing to audit")
        served = finished[0]
        return Audited(served, audit_served(self._router, served, dtype))

    def replayable(self, message: ApiRequest, fields: Fields = GRPC_FIELDS) -> ApiRequest:
        """`message`, validated as Generate validates it, as it must run to be replayed: a
        seed-exact request without a seed gets one. `NotReplayableError` for a sampled
        request the rejection rule would serve."""
        request, _ = self._service.reader.to_request(message)
        rule = replay_rule(request.sampling)
        if rule is None:
            named = message.rule == REJECTION
            param = fields.rule if named else fields.seed
            raise NotReplayableError(
                f"{param}: only greedy and seed-exact requests can be audited token by token; "
                "this one samples by the rejection rule, whose tokens depend on how it was "
                f"drafted: send a {fields.seed}, or {fields.rule} seed_exact, or "
                f"{fields.temperature} 0",
                param,
            )
        if rule == GREEDY or message.seed is not None:
            return message
        # The seed picked for it: the replay must know it.
        return dataclasses.replace(message, seed=request.seed, rule=SEED_EXACT_RULE)
