"""The router as Serve's ingress: the public `tandem.v1.Tandem` API (Audit included) and gRPC
health, and the OpenAI-compatible HTTP API (`__call__`, `cluster.serve.http`, with
`POST /v1/audit`) over the same service and tenants; `config.audit` turns the online audit on.

Every call is authenticated by its `authorization` metadata against the config's tenants
(`cluster.api.tenants`); health checks are open, so that probes need no key: gRPC health, and
the HTTP face's `GET /health`, `/version` and `/metrics` (`IngressProbes`). Both health checks
say the same: serving while at least one verifier replica is live. `/metrics` scrapes every
live node's Ray metrics agent (where `tandem status` reads them too) and serves Tandem's metrics
of them, names as the agents serve them (`ray_tandem_...`,
`cluster.metrics.scrape.tandem_exposition`).

A thin shell (the app builder applies `serve.deployment`): Serve's gRPC proxy calls the method
named like the RPC, and each is the public API's one servicer's
(`cluster.serve.tandem_servicer.TandemServicer`, the same behind every door: generation as
steps on this replica's event loop, a stream's pending chunks merged into one `GenerateChunk`
each time Serve asks for the next, a cancelled call's sessions freed). What the ingress injects
is what Serve's proxy changes: the caller's deadline comes from metadata (below), and a failed
call's status is set on Serve's context, which has no `abort`. gRPC health is
`cluster.serve.front_grpc.AsyncHealthServicer`'s, its watches bounded as on the router's own
server.

The router's own servers (`config.front`, `cluster.serve.front.RouterFront`): the same two
APIs on ports of this replica, over the same service, with no Serve proxy in between.

Context limit: the service is given `verifier_limits.max_context_tokens`, so a request whose
prompt plus `max_tokens` cannot fit is INVALID_ARGUMENT before it runs
(`cluster.api.request_reader`).

Deadlines: Serve's gRPC proxy (Ray 2.60) passes the client's metadata but not its gRPC
deadline, so a client states it in `x-tandem-deadline-ms` (`DEADLINE_METADATA_KEY`: the
milliseconds it has left when it sends the call; `TandemClient` sends it with every call that
has a timeout), read by `cluster.serve.calls.deadline_of` as this replica's clock at arrival
plus that, then honoured as on the router's own server; a malformed value is INVALID_ARGUMENT.
A call with only a gRPC timeout still ends on time (the proxy cancels it), but its replicas
learn no time limit. docs/architecture.md, "Deadlines".
"""

from __future__ import annotations

import contextlib
import logging
import urllib.request
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn

import ray
from grpc_health.v1 import health_pb2
from starlette.requests import Request
from starlette.responses import Response

from cluster.api.caller import Caller
from cluster.api.openai import OpenAIService, served_model_name
from cluster.api.service import TandemService
from cluster.api.status import status_of, trailers_of
from cluster.api.tenants import Tenants, bearer_key
from cluster.api.tool_formats import choose_format
from cluster.config import TandemConfig
from cluster.local import text_decoder
from cluster.metrics.scrape import tandem_exposition
from cluster.routing.directory import RegistryPool, from_registry_actor
from cluster.routing.registry import get_registry
from cluster.routing.router import Router
from cluster.runtime.constraint import grammar_tokenizer_of, warm_up
from cluster.runtime.errors import TandemError
from cluster.runtime.models import load_tokenizer
from cluster.serve.calls import deadline_of
from cluster.serve.front import RouterFront
from cluster.serve.front_grpc import AsyncHealthServicer
from cluster.serve.http import OpenAIHttp
from cluster.serve.tandem_servicer import TandemServicer
from cluster.wire.status import put_status
from protos import generate_pb2

logger = logging.getLogger(__name__)

MAX_CONCURRENT_REQUESTS = 256
HEALTH_WATCH_PERIOD_S = 1.0
SCRAPE_TIMEOUT_S = 5.0
"""How long `GET /metrics` waits for each node's metrics agent."""


class MetricsUnavailableError(TandemError):
    """No node's metrics agent answered a scrape (HTTP 503)."""

    status = "UNAVAILABLE"


class IngressProbes:
    """The HTTP face's probes (`cluster.serve.http.ServerProbes`) over the router's pool."""

    def __init__(self, pool: RegistryPool) -> None:
        self._pool = pool

    def healthy(self) -> bool:
        """At least one verifier replica is live (a registry that cannot be read: no)."""
        try:
            return any(r.side == "verifier" for r in self._pool.replicas())
        except Exception:
            return False

    def metrics_text(self) -> str:
        """Tandem's metrics from every live node's metrics agent that answers."""
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # cluster-internal
        endpoints = [
            f"{node['NodeManagerAddress']}:{node['MetricsExportPort']}"
            for node in ray.nodes()
            if node.get("Alive") and node.get("MetricsExportPort")
        ]
        pages = []
        for endpoint in endpoints:
            try:
                with direct.open(f"http://{endpoint}/metrics", timeout=SCRAPE_TIMEOUT_S) as page:
                    pages.append(page.read().decode())
            except OSError as error:
                logger.warning("the metrics agent at %s did not answer: %s", endpoint, error)
        if endpoints and not pages:
            raise MetricsUnavailableError("no node's metrics agent answered")
        return tandem_exposition(pages)


class RouterIngress:
    """Serve ingress body: the public API over a router whose replicas come from the registry."""

    def __init__(
        self,
        config: TandemConfig,
        drafters: Any = None,
        verifiers: Any = None,
        suffix_drafters: Any = None,
    ) -> None:
        # `drafters`, `verifiers` and `suffix_drafters` are the sides' deployment handles: bound
        # so that Serve deploys them with this application. Blocks never go through them.
        self._config = config
        loaded = load_tokenizer(config.models.pair().target)
        grammar_tokenizer = grammar_tokenizer_of(loaded.tokenizer, loaded.eos_token_ids)
        warm_up(grammar_tokenizer)  # checking a request's grammar needs it: build it now
        self._pool = RegistryPool(
            from_registry_actor(get_registry(config.app_name)),
            rpc_timeout_s=config.replica_rpc_timeout_s,
            secret=config.cluster_secret,
        )
        self._router = Router.over_pool(
            self._pool,
            text_decoder(loaded.tokenizer),
            loaded.eos_token_ids,
            pipelined=config.api.default_pipelined,
            predraft_fan_out=config.api.default_predraft_fan_out,
            ngram=config.prompt_lookup,
            draft_length=config.draft_length,
            decode_special=text_decoder(loaded.tokenizer, skip_special_tokens=False),
            grammar_tokenizer=grammar_tokenizer,
        )
        self._service = TandemService(
            self._router,
            loaded.tokenizer,
            config.api,
            tenants=Tenants(config.auth),
            max_context_tokens=config.verifier_limits.max_context_tokens,
            audit=config.audit,
        )
        self._threads = ThreadPoolExecutor(MAX_CONCURRENT_REQUESTS, thread_name_prefix="request")
        self._grpc = TandemServicer(self._service, self._threads, _caller, _fail)
        tool_format = choose_format(
            config.api.tool_parser or config.models.tool_parser(),
            self._service.reader.chat_template,
        )
        openai = OpenAIService(self._service, served_model_name(config.models), tool_format)
        self._probes = IngressProbes(self._pool)
        self._health = AsyncHealthServicer(self._probes.healthy, config.front, _fail)
        self._http = OpenAIHttp(
            openai,
            self._threads,
            self._probes,
            max_body_bytes=config.front.max_body_bytes,
            body_timeout_s=config.front.body_timeout_s,
        )
        self._front = (
            RouterFront(config.front, self._service, self._http, self._probes.healthy)
            if config.front.enabled
            else None
        )

    async def __call__(self, request: Request) -> Response:
        """Serve's HTTP proxy: the OpenAI-compatible API (`cluster.serve.http`)."""
        return await self._http(request)

    # The public gRPC API through Serve's proxy: the one servicer's calls, by name.

    async def Generate(
        self, request: generate_pb2.GenerateRequest, grpc_context: Any = None
    ) -> generate_pb2.GenerateResponse:
        return await self._grpc.Generate(request, grpc_context)

    async def GenerateStream(
        self, request: generate_pb2.GenerateRequest, grpc_context: Any = None
    ) -> AsyncIterator[generate_pb2.GenerateChunk]:
        # Closed with this call (an abandoned `async for` would leave it open until collected,
        # and its sessions held until then).
        async with contextlib.aclosing(self._grpc.GenerateStream(request, grpc_context)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def Cancel(
        self, request: generate_pb2.CancelRequest, grpc_context: Any = None
    ) -> generate_pb2.CancelResponse:
        return await self._grpc.Cancel(request, grpc_context)

    async def GetUsage(
        self, request: generate_pb2.UsageRequest, grpc_context: Any = None
    ) -> generate_pb2.TenantUsage:
        return await self._grpc.GetUsage(request, grpc_context)

    async def Audit(
        self, request: generate_pb2.AuditRequest, grpc_context: Any = None
    ) -> generate_pb2.AuditResponse:
        return await self._grpc.Audit(request, grpc_context)

    async def Check(
        self, request: health_pb2.HealthCheckRequest, grpc_context: Any = None
    ) -> health_pb2.HealthCheckResponse:
        """SERVING while at least one verifier replica is live."""
        return await self._health.Check(request, grpc_context)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, grpc_context: Any = None
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        async with contextlib.aclosing(self._health.Watch(request, grpc_context)) as statuses:
            async for status in statuses:
                yield status

    def __del__(self) -> None:
        front = getattr(self, "_front", None)
        if front is not None:
            front.close()  # first: no new calls while the rest shuts down
        service = getattr(self, "_service", None)
        if service is not None:
            # The online audit's worker: an audit in flight fails once the pool's channels close.
            service.close(timeout_s=1.0)
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.close()


def _caller(grpc_context: Any) -> Caller:
    """The call's `authorization` metadata and the deadline its `x-tandem-deadline-ms` metadata
    states (see the module docstring)."""
    metadata = grpc_context.invocation_metadata() if grpc_context is not None else ()
    return Caller(bearer_key(metadata), deadline_of(metadata))


async def _fail(grpc_context: Any, error: Exception) -> NoReturn:
    """Give the client the error's status, message and trailers (Serve's context has no
    `abort`: the proxy sends what is set on it), then end the call."""
    if grpc_context is not None:
        put_status(grpc_context, *status_of(error), trailers_of(error))
    raise error
