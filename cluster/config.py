"""The service's configuration: one frozen dataclass per part, each checking its own values.

`TandemConfig.from_dict` (and `from_yaml`) is the one place a config file is parsed
(cluster/config_parsing.py): types are checked strictly, unknown keys are rejected, and every
problem is reported at once with its key's path (`verifier.max_sesions: unknown key`), so a
typo never silently falls back to a default. Configs built in Python skip the type checks, not
the value checks. No I/O happens when a config is built; models load in the replicas.

Plain data: each part's class lives beside what it configures, in a module that imports no
component (`drafter.config`, `verifier.config`, `cluster.autoscaling_config`,
`cluster.api.audit_config`, `cluster.api.service_config`, `cluster.routing.draft_length_config`,
`cluster.runtime.model_spec`...), so reading a config loads no torch, no model, no Ray and no
`cluster.serve` (checked by `make lint`: "Configs are plain data").
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import with_config

from cluster.api.audit_config import AuditConfig
from cluster.api.service_config import ServiceConfig
from cluster.api.tenants import AuthConfig
from cluster.autoscaling_config import AutoscalingConfig
from cluster.config_parsing import PARSING, load_yaml, parse
from cluster.presets import DEFAULT_PRESET, PRESETS, ModelPair, resolve_pair
from cluster.routing.draft_length_config import DraftLengthConfig
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.model_spec import QUANTIZATIONS
from drafter.config import DrafterConfig, NgramConfig, SuffixConfig
from verifier.config import VerifierConfig

DEFAULT_APP_NAME = "tandem"
DEFAULT_GRPC_PORT = 9000
"""The public gRPC API: the router replicas' own server (`FrontConfig.grpc_port`)."""
DEFAULT_HTTP_PORT = 8000
"""The OpenAI-compatible API: the router replicas' own server (`FrontConfig.http_port`)."""
DEFAULT_PROXY_GRPC_PORT = DEFAULT_GRPC_PORT + 1
"""Serve's gRPC proxy (`TandemConfig.proxy_grpc_port`): the same API, the second door."""


@dataclass(frozen=True)
class ReplicaGroupConfig:
    """How many replicas of one deployment, and what each asks Ray for (its placement)."""

    num_replicas: int = 1
    num_cpus: float = 0.0
    """Logical CPUs reserved per replica (0: none, so a small machine fits every replica)."""
    num_gpus: float = 0.0
    accelerator_type: str | None = None
    """Ray accelerator type, e.g. "L4" for drafters and "H100" for verifiers."""
    resources: dict[str, float] = field(default_factory=dict)
    """Ray resources each replica asks for beyond CPUs and GPUs: a custom resource some nodes
    advertise pins the side to those nodes (a node type), e.g. {"tandem_drafter_node": 0.01}
    (see deploy/placement/nodes.yaml and deploy/README.md)."""
    torch_threads: int = 0
    """Intra-op threads per replica (0: fit the machine, one per CPU the replica may run on,
    after pinning to `cpus`; on the 2-core CPU this measured fastest for one stream, and the
    engine batches concurrent streams; see docs/benchmarks.md)."""
    cpus: list[int] = field(default_factory=list)
    """CPU ids every replica of this group is pinned to (empty: not pinned). On one machine,
    e.g. [0] for drafters and [1] for verifiers gives each side a core of its own."""
    autoscaling: AutoscalingConfig = field(default_factory=AutoscalingConfig)
    """Drafters and verifiers only: scale this group on its replicas' load."""
    quantization: str | None = None
    """Drafters only: the draft's weights, `none`, `int8` (weight-only, per output channel),
    `int8-dynamic` (CPU; activations too) or `int4` (weight-only, grouped); see
    `cluster.runtime.quantize`. Unset: the preset's
    choice. The target is never quantized."""
    trimmed_vocab: int | None = None
    """Drafters only: the draft scores only this many most frequent token ids (FR-Spec; 0: all
    of them); see `cluster.runtime.vocab`. Unset: the preset's choice. Lossless either way."""

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise InvalidArgumentError(f"num_replicas must be >= 1, got {self.num_replicas}")
        for name in ("num_cpus", "num_gpus"):
            if getattr(self, name) < 0:
                raise InvalidArgumentError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.torch_threads < 0:
            raise InvalidArgumentError(f"torch_threads must be >= 0, got {self.torch_threads}")
        if any(isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < 0 for cpu in self.cpus):
            raise InvalidArgumentError(f"cpus must be CPU ids (ints >= 0), got {self.cpus}")
        if self.trimmed_vocab is not None and self.trimmed_vocab < 0:
            raise InvalidArgumentError(f"trimmed_vocab must be >= 0, got {self.trimmed_vocab}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise InvalidArgumentError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )

    def ray_actor_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.accelerator_type:
            options["accelerator_type"] = self.accelerator_type
        if self.resources:
            options["resources"] = dict(self.resources)
        return options


@dataclass(frozen=True)
class ModelsConfig:
    """Which target/draft pair to serve: a preset, with optional overrides."""

    preset: str = DEFAULT_PRESET
    target: str | None = None
    draft: str | None = None
    dtype: str | None = None
    device: str | None = None

    def __post_init__(self) -> None:
        self.pair()  # validates the preset and the model specs

    def pair(self) -> ModelPair:
        return resolve_pair(self.preset, self.target, self.draft, self.dtype, self.device)

    def tool_parser(self) -> str:
        """The preset's tool-call format ("": the chat template's), unless the target is
        another model."""
        return "" if self.target else PRESETS[self.preset].tool_parser


@dataclass(frozen=True)
class FrontConfig:
    """The router replicas' own servers for the public APIs (`cluster.serve.front`), the
    default door: no Serve proxy between the client and the router. Every router replica on a
    node binds these ports (SO_REUSEPORT); None: that server is not started (Serve's proxies,
    the second door, always serve the same APIs)."""

    grpc_port: int | None = DEFAULT_GRPC_PORT
    """`tandem.v1.Tandem` and gRPC health."""
    http_port: int | None = DEFAULT_HTTP_PORT
    """The OpenAI-compatible API, probes included."""
    host: str = "0.0.0.0"
    """The address both bind (every interface: a Kubernetes Service reaches the pod's)."""
    max_request_bytes: int = 4 * 1024 * 1024
    """The largest gRPC request message read (RESOURCE_EXHAUSTED past it, never parsed): a
    prompt at the longest context the packs serve is well under 1 MiB."""
    max_body_bytes: int = 4 * 1024 * 1024
    """The largest HTTP request body read, on both doors (413 past it)."""
    body_timeout_s: float = 30.0
    """How long an HTTP request's body may take to arrive once its headers have (408 past it)."""
    header_timeout_s: float = 10.0
    """How long an HTTP request's headers may take to arrive, from the connection's opening or
    its last answer: past it the default door closes the connection."""
    max_health_watches: int = 64
    """gRPC health `Watch` streams held at once (RESOURCE_EXHAUSTED past them: a probe that
    polls uses `Check`), so that they never take the slots `Generate` needs."""
    max_health_watches_per_caller: int = 8
    """Of those, the most one caller (one peer address) holds."""

    def __post_init__(self) -> None:
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            if port is not None and not 0 < port < 65536:
                raise InvalidArgumentError(f"front.{name} must be in 1..65535, got {port}")
        if not self.host:
            raise InvalidArgumentError("front.host must name an address")
        for name in (
            "max_request_bytes",
            "max_body_bytes",
            "max_health_watches",
            "max_health_watches_per_caller",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"front.{name} must be an integer >= 1, got {value!r}")
        for name in ("body_timeout_s", "header_timeout_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgumentError(f"front.{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def enabled(self) -> bool:
        return self.grpc_port is not None or self.http_port is not None


CLUSTER_SECRET_ENV = "TANDEM_CLUSTER_SECRET"
"""Environment variable that holds the cluster's shared secret (see TandemConfig)."""
MIN_SECRET_CHARS = 16


@with_config(PARSING)
@dataclass(frozen=True)
class TandemConfig:
    """Everything `tandem serve` deploys."""

    app_name: str = DEFAULT_APP_NAME
    proxy_grpc_port: int = DEFAULT_PROXY_GRPC_PORT
    """Port of Serve's gRPC proxy: the public API's second door (the router replicas' own
    servers, `front`, are the first). Whoever starts Serve binds it: `tandem serve` (default
    `--port` + 1), or a Serve config's `grpc_options.port` (keep the two equal)."""
    front: FrontConfig = field(default_factory=FrontConfig)
    """The router replicas' own servers for the public APIs, the default door: gRPC on 9000,
    HTTP on 8000 unless set otherwise (null: that server is not started)."""
    models: ModelsConfig = field(default_factory=ModelsConfig)
    api: ServiceConfig = field(default_factory=ServiceConfig)
    """Defaults and limits of the public API (draft length, pipelining, max_tokens)."""
    router: ReplicaGroupConfig = field(default_factory=ReplicaGroupConfig)
    drafter: ReplicaGroupConfig = field(default_factory=ReplicaGroupConfig)
    verifier: ReplicaGroupConfig = field(default_factory=ReplicaGroupConfig)
    drafter_limits: DrafterConfig = field(default_factory=DrafterConfig)
    verifier_limits: VerifierConfig = field(default_factory=VerifierConfig)
    suffix: ReplicaGroupConfig = field(default_factory=ReplicaGroupConfig)
    """The suffix drafter replicas (`suffix_drafter`): CPU-only (a GPU asked for is refused),
    one by default."""
    suffix_drafter: SuffixConfig = field(default_factory=SuffixConfig)
    """The suffix drafter: blocks continuing what the tenant's earlier requests (and the
    request itself) wrote, from indexes on CPU-only replicas; the router verifies its block
    where it proposes one and drafts with the model otherwise. On by default: where nothing
    recurs it proposes nothing and the router stops asking for a while. `enabled: false`
    deploys no suffix replica."""
    prompt_lookup: NgramConfig = field(default_factory=lambda: NgramConfig(enabled=True))
    """The router's prompt lookup: blocks copied from the token history when its last few
    tokens recur, the draft model otherwise. On by default: free blocks, lossless."""
    draft_length: DraftLengthConfig = field(default_factory=lambda: DraftLengthConfig(enabled=True))
    """The router's adaptive plan per request and round: block length up to the request's
    draft_tokens, serial or pipelined, 0 when speculation does not pay. On by default: it is
    what keeps speculation from running slower than the target alone on a busy cluster."""
    audit: AuditConfig = field(default_factory=AuditConfig)
    """The online audit: a share (`fraction`) of finished greedy and seed-exact requests
    replayed through the target alone, at low priority, and compared token by token
    (`tandem_audit_checked_total`, `tandem_audit_mismatched_total`). Off by default."""
    auth: AuthConfig = field(default_factory=AuthConfig)
    """Tenants, their hashed API keys and limits. On by default: with no tenants the
    application refuses to build, unless `enabled: false` says so (local development)."""
    replica_rpc_timeout_s: float | None = 60.0
    """The window a router waits for a replica's answer (or a running session's report)
    before it asks whether the replica is busy or dead (`cluster.routing.liveness`): busy
    (heard from, or its engine stepped) it waits another window; dead or stalled, it fails
    the call over. None: it waits as long as the request's deadline allows."""
    cluster_secret: str | None = field(default=None, repr=False)
    """The shared secret every call to a replica's internal API must carry, so that nothing
    but this application's router can drive a replica. None: $TANDEM_CLUSTER_SECRET, else one
    made up when the application is built. Never logged; prefer the environment (a Kubernetes
    Secret) to writing it in a config file."""

    def __post_init__(self) -> None:
        if not self.app_name or not self.app_name.replace("-", "").replace("_", "").isalnum():
            raise InvalidArgumentError(
                f"app_name must be alphanumeric (with - or _), got {self.app_name!r}"
            )
        if not 0 < self.proxy_grpc_port < 65536:
            raise InvalidArgumentError(
                f"proxy_grpc_port must be in 1..65535, got {self.proxy_grpc_port}"
            )
        if self.suffix.num_gpus > 0 or self.suffix.accelerator_type:
            raise InvalidArgumentError(
                "suffix: the suffix drafter runs on CPUs only (set no num_gpus or accelerator_type)"
            )
        for side in ("router", "verifier", "suffix"):
            for key in ("quantization", "trimmed_vocab"):
                if getattr(getattr(self, side), key) is not None:
                    raise InvalidArgumentError(
                        f"{side}.{key}: only the drafter's model may be changed (the target's "
                        "output is what Tandem reproduces; the suffix drafter has none)"
                    )
        if self.cluster_secret is not None and len(self.cluster_secret) < MIN_SECRET_CHARS:
            raise InvalidArgumentError(
                f"cluster_secret must have at least {MIN_SECRET_CHARS} characters"
            )

    def pair(self) -> ModelPair:
        """The models to serve: `models`' pair, the draft quantized and trimmed as `drafter`
        says (where it says nothing, as the preset does)."""
        pair = self.models.pair()
        changes: dict[str, Any] = {}
        if self.drafter.quantization is not None:
            changes["quantization"] = self.drafter.quantization
        if self.drafter.trimmed_vocab is not None:
            changes["trimmed_vocab"] = self.drafter.trimmed_vocab
        if not changes:
            return pair
        return ModelPair(pair.target, dataclasses.replace(pair.draft, **changes))

    def with_cluster_secret(self) -> TandemConfig:
        """This config with its cluster secret settled: its own, else $TANDEM_CLUSTER_SECRET,
        else a new random one."""
        if self.cluster_secret is not None:
            return self
        secret = os.environ.get(CLUSTER_SECRET_ENV) or secrets.token_hex(32)
        return dataclasses.replace(self, cluster_secret=secret)

    @classmethod
    def from_dict(cls, data: object) -> TandemConfig:
        """Parse a config file's content; raises ConfigError listing every problem found."""
        return parse(cls, data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> TandemConfig:
        return parse(cls, load_yaml(path))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
