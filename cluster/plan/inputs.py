"""What a plan is computed from: the drafter kinds' costs, the host's CPU cost, acceptance by
workload category, all plain data validated when built.

Words:

- a *kind* is how drafts are made: `model` (a draft model on a device of its own), `suffix` (a
  suffix tree over earlier requests' text, on a CPU core of the drafter replica),
  `self-int4` (the target's own int4 copy, on the verifier's device) or `none` (the target
  alone);
- *alpha* is the per-token acceptance: the chance that a drafted token is accepted, given the
  ones before it were (`cluster.runtime.sim.expected_tokens` turns it into tokens a verify
  pass commits);
- a *round* is one verify pass of one stream (k drafted tokens and the bonus); its tokens
  number E = (1 - alpha^(k+1)) / (1 - alpha), or 1 for the target alone;
- a *request* prefills its `prompt_tokens` on the verifier's device (and on it again where the
  draft shares that device) before it generates `output_tokens`.

No I/O here: `cluster.cli.plan` reads files and hands the parsed objects in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cluster.plan.solve import increasing_root
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.sim_source import DeviceProfile

KINDS = ("model", "suffix", "self-int4", "none")
"""The drafter kinds, in report order."""
TARGET_ALONE = "none"


@dataclass(frozen=True)
class DrafterCost:
    """What drafting a block costs, by where the drafts are made.

    `placement` picks the formula of a k-token block's time at batch N (`draft_block_s` in
    `cluster.plan.model`):

    - `own_device`: k steps of `device` (a separate accelerator), which may overlap the verify
      pass (pipelined rounds);
    - `verifier_device`: k steps costing `target_ratio` of a target step at the same batch,
      on the verifier's own device: never overlapping the verify pass;
    - `host_cpu`: one lookup of `cpu_ms_per_round` per stream (a replica serves its streams in
      turn) plus a `hop_ms` round trip, overlapping the verify pass;
    - `none`: no drafting at all.
    """

    kind: str
    placement: str
    device: DeviceProfile | None = None
    target_ratio: float = 0.0
    cpu_ms_per_round: float = 0.0
    hop_ms: float = 0.0
    replica_cpu_ms_per_token: float = 0.0
    """The drafter replica's own CPU per generated token (its engine, its wire): one replica
    has one core's worth (a Python process), which bounds the tokens it keeps up with."""
    source: str = ""
    exchange_cpu_ms_per_round: float = 0.0
    """Host CPU a drafting round costs beyond a target-alone one for the exchange with the
    drafter (the router's calls and frames), where the plan's host runs the router."""
    cpu_ms_per_drafted_token: float = 0.0
    """The drafter replica's CPU a drafted token, where the replica runs on the plan's host
    (0 where its work is priced on a device)."""
    prefill_ratio: float | None = None
    """A `verifier_device` draft's prefill of a prompt as a share of the target's; None:
    `target_ratio` (a CPU's int4 kernels decode fast but prefill slower than bf16)."""

    def __post_init__(self) -> None:
        placements = ("own_device", "verifier_device", "host_cpu", "none")
        if self.kind not in KINDS:
            raise InvalidArgumentError(f"unknown drafter kind {self.kind!r}; known: {KINDS}")
        if self.placement not in placements:
            raise InvalidArgumentError(f"{self.kind}: placement must be one of {placements}")
        if self.placement == "own_device" and self.device is None:
            raise InvalidArgumentError(f"{self.kind}: a drafter on its own device needs a profile")
        if self.placement == "verifier_device" and not 0.0 < self.target_ratio <= 1.0:
            raise InvalidArgumentError(f"{self.kind}: target_ratio must be in (0, 1]")
        for name in (
            "cpu_ms_per_round",
            "hop_ms",
            "replica_cpu_ms_per_token",
            "prefill_ratio",
            "exchange_cpu_ms_per_round",
            "cpu_ms_per_drafted_token",
        ):
            if (getattr(self, name) or 0.0) < 0:
                raise InvalidArgumentError(f"{self.kind}: {name} must be >= 0")

    @property
    def overlaps_verify(self) -> bool:
        """Whether a block can be drafted while the previous one is verified."""
        return self.placement in ("own_device", "host_cpu")

    def host_cpu_ms_per_round(self, draft_tokens: int) -> float:
        """The host CPU a drafting round of `draft_tokens` adds: the exchange, a CPU
        drafter's lookup, and the drafter replica's work on its drafted tokens."""
        lookup = self.cpu_ms_per_round if self.placement == "host_cpu" else 0.0
        return (
            self.exchange_cpu_ms_per_round + lookup + self.cpu_ms_per_drafted_token * draft_tokens
        )

    @property
    def prefill_share(self) -> float:
        """The draft's prefill of a prompt, as a share of the target's, paid on the verifier's
        device: a draft on that device prefills every prompt too; one on a device of its own
        or a CPU lookup costs the verifier nothing."""
        if self.placement != "verifier_device":
            return 0.0
        return self.target_ratio if self.prefill_ratio is None else self.prefill_ratio


@dataclass(frozen=True)
class HostCost:
    """Tandem's own cost on the host, beside the modelled device.

    The host is a queue of `usable_cores` cores that every generated token visits for
    `cpu_ms_per_token + (cpu_ms_per_round + cpu_ms_per_step / N) / E` of CPU (router, drafter,
    verifier, proxy: the service's processes and the load client): a part paid for every
    token streamed, a part for every round of a stream (its frame entries, its verify and
    commit, its chunk), whose E tokens share it, and work a verifier's step shares among its N
    streams. A round also waits `latency_ms_per_round` outside the device and any core (gRPC
    hops, thread wake-ups)."""

    usable_cores: float
    cpu_ms_per_token: float
    cpu_ms_per_step: float = 0.0
    latency_ms_per_round: float = 0.0
    source: str = ""
    cpu_ms_per_round: float = 0.0
    critical_share: float = 1.0
    """The share of that CPU on a token's own round's path; the rest (streaming, the client,
    background work) takes cores without delaying the round (`closed_loop_rate`)."""

    def __post_init__(self) -> None:
        if self.usable_cores <= 0:
            raise InvalidArgumentError(f"usable_cores must be > 0, got {self.usable_cores}")
        if not 0.0 < self.critical_share <= 1.0:
            raise InvalidArgumentError(
                f"critical_share must be in (0, 1], got {self.critical_share}"
            )
        for name in (
            "cpu_ms_per_token",
            "cpu_ms_per_round",
            "cpu_ms_per_step",
            "latency_ms_per_round",
        ):
            if getattr(self, name) < 0:
                raise InvalidArgumentError(f"{name} must be >= 0, got {getattr(self, name)}")

    def cpu_ms(self, streams_per_verifier: int, tokens_per_round: float = 1.0) -> float:
        """CPU ms a token costs when each verifier step serves that many streams, each round
        committing `tokens_per_round` tokens."""
        per_round = self.cpu_ms_per_round + self.cpu_ms_per_step / max(streams_per_verifier, 1)
        return self.cpu_ms_per_token + per_round / max(tokens_per_round, 1.0)


@dataclass(frozen=True)
class RouterCost:
    """What a router replica (one Python process: its event loop reads the verifier's reports,
    commits, streams) spends per token it serves, measured by process (`tandem loadtest`'s CPU
    by role), and the share of a core one process can give. How many routers a verifier needs
    is what keeps its device fed (`cluster.plan.model.router_load`)."""

    cpu_ms_per_token: float
    """The router's CPU a committed token, the target alone."""
    cpu_ms_per_round: float = 0.0
    """More a drafting round (its drafts and posts)."""
    core_share: float = 0.8
    source: str = ""

    def __post_init__(self) -> None:
        if self.cpu_ms_per_token < 0 or self.cpu_ms_per_round < 0:
            raise InvalidArgumentError("router CPU figures must be >= 0")
        if not 0.0 < self.core_share <= 1.0:
            raise InvalidArgumentError(f"core_share must be in (0, 1], got {self.core_share}")


Acceptance = Mapping[str, Mapping[str, float]]
"""category -> kind -> alpha."""


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan needs but the load: the target's cost curve, the drafter kinds, the
    host, acceptance by category, and the streams' mean context."""

    name: str
    target: DeviceProfile
    drafters: Mapping[str, DrafterCost]
    host: HostCost
    acceptance: Acceptance
    context_tokens: int = 256
    max_draft_tokens: int = 8
    sources: Mapping[str, str] = field(default_factory=dict)
    """Where each group of figures was measured or taken from, for the report."""
    prompt_tokens: int = 0
    """A request's mean prompt length, prefilled on the verifier's device (0: not priced)."""
    output_tokens: int = 64
    """A request's mean generated tokens, among which its prefill's cost is shared."""
    prefill_s_per_token: float | None = None
    """The target's device time a prompt token in a prefill; None: its step's `per_token_s`
    (a batched pass's marginal token, the sim engine's own price)."""
    prefill_s_per_token_squared: float | None = None
    """A prefill's attention: this times P^2 more (each prompt token reads the ones before it);
    None: half the step's `per_context_s`, as the sim engine prices a prompt's attended KV."""
    device_is_host: bool = False
    """The "device" is the host's own cores (a model on a CPU): its speed moves with the
    machine's state, and `tandem plan --calibrate` refits it with the host term."""
    sampled_host: HostCost | None = None
    """The host term for sampled requests where it differs from greedy ones' (`host`): the
    simulated verifier spends about twice the CPU a token sampling (`tandem plan --sampled`)."""
    router: RouterCost = field(default_factory=lambda: RouterCost(cpu_ms_per_token=0.3))
    """A router replica's CPU per token: how many routers a verifier needs."""

    def __post_init__(self) -> None:
        if self.context_tokens < 0:
            raise InvalidArgumentError("context_tokens must be >= 0")
        if self.prompt_tokens < 0 or self.output_tokens < 1:
            raise InvalidArgumentError("prompt_tokens must be >= 0 and output_tokens >= 1")
        for name in ("prefill_s_per_token", "prefill_s_per_token_squared"):
            if (getattr(self, name) or 0.0) < 0:
                raise InvalidArgumentError(f"{name} must be >= 0")
        if self.max_draft_tokens < 1:
            raise InvalidArgumentError("max_draft_tokens must be >= 1")
        validate_acceptance(self.acceptance)

    def prefill_s(self) -> float:
        """The target's device time of one request's prefill: P t + P^2 t2."""
        linear = self.prefill_s_per_token
        squared = self.prefill_s_per_token_squared
        linear = self.target.per_token_s if linear is None else linear
        squared = self.target.per_context_s / 2 if squared is None else squared
        return self.prompt_tokens * linear + self.prompt_tokens**2 * squared

    def prefill_s_per_generated_token(self, cost: DrafterCost | None) -> float:
        """The verifier device's prefill time a generated token: the prefill x (1 + the draft's
        share) / G, where `cost` (None: the target alone) drafts."""
        share = cost.prefill_share if cost is not None else 0.0
        return self.prefill_s() * (1.0 + share) / self.output_tokens


def validate_acceptance(acceptance: Acceptance) -> None:
    """InvalidArgumentError unless every figure is an alpha in [0, 1] of a known kind."""
    if not acceptance:
        raise InvalidArgumentError("no categories in the acceptance table")
    for category, by_kind in acceptance.items():
        for kind, alpha in by_kind.items():
            if kind not in KINDS:
                raise InvalidArgumentError(f"{category}: unknown drafter kind {kind!r}")
            if not isinstance(alpha, int | float) or not 0.0 <= alpha <= 1.0:
                raise InvalidArgumentError(f"{category}.{kind}: alpha must be in [0, 1]")


def alpha_from_rate(rate: float, k: int) -> float:
    """The per-token alpha whose k-token blocks accept a share `rate` of drafted tokens: the
    root of alpha (1 - alpha^k) / ((1 - alpha) k) = rate (increasing in alpha), by bisection."""
    if not 0.0 <= rate <= 1.0 or k < 1:
        raise InvalidArgumentError(f"an acceptance rate in [0, 1] and k >= 1, got {rate}, {k}")
    # expected accepted of k drafted, over k
    return increasing_root(lambda a: sum(a**i for i in range(1, k + 1)) / k, rate)


def acceptance_from_json(data: Any) -> dict[str, dict[str, float]]:
    """An acceptance table from parsed JSON: either {category: {kind: alpha}}, or a `tandem
    bench` result, whose `by_category` acceptance rates (of `config.draft_tokens`-token
    blocks, the draft model's) become the `model` kind's alpha."""
    if not isinstance(data, dict):
        raise InvalidArgumentError("acceptance: expected a JSON object")
    if "by_category" in data:
        k = int((data.get("config") or {}).get("draft_tokens") or 4)
        table = {}
        for category, stats in data["by_category"].items():
            rate = stats.get("acceptance_rate") if isinstance(stats, dict) else None
            if rate is None:
                continue
            table[category] = {"model": alpha_from_rate(float(rate), k)}
    else:
        table = {}
        for category, by_kind in data.items():
            if not isinstance(by_kind, dict):
                raise InvalidArgumentError(f"acceptance {category!r}: expected {{kind: alpha}}")
            table[str(category)] = {str(kind): alpha for kind, alpha in by_kind.items()}
    validate_acceptance(table)
    return table
