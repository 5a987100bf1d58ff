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
  number E = (1 - alpha^(k+1)) / (1 - alpha), or 1 for the target alone.

No I/O here: `cluster.cli.plan` reads files and hands the parsed objects in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

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
        for name in ("cpu_ms_per_round", "hop_ms", "replica_cpu_ms_per_token"):
            if getattr(self, name) < 0:
                raise InvalidArgumentError(f"{self.kind}: {name} must be >= 0")

    @property
    def overlaps_verify(self) -> bool:
        """Whether a block can be drafted while the previous one is verified."""
        return self.placement in ("own_device", "host_cpu")


@dataclass(frozen=True)
class HostCost:
    """Tandem's own cost on the host, beside the modelled device.

    The host is a queue of `usable_cores` cores that every generated token visits for
    `cpu_ms_per_token + cpu_ms_per_step / N` of CPU (router, drafter, verifier, proxy: the
    service's processes and the load client; the second part is work a verifier's step shares
    among its N streams), and a round also waits `latency_ms_per_round` outside the device and
    any core (gRPC hops, thread wake-ups)."""

    usable_cores: float
    cpu_ms_per_token: float
    cpu_ms_per_step: float = 0.0
    latency_ms_per_round: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        if self.usable_cores <= 0:
            raise InvalidArgumentError(f"usable_cores must be > 0, got {self.usable_cores}")
        for name in ("cpu_ms_per_token", "cpu_ms_per_step", "latency_ms_per_round"):
            if getattr(self, name) < 0:
                raise InvalidArgumentError(f"{name} must be >= 0, got {getattr(self, name)}")

    def cpu_ms(self, streams_per_verifier: int) -> float:
        """CPU ms a token costs when each verifier step serves that many streams."""
        return self.cpu_ms_per_token + self.cpu_ms_per_step / max(streams_per_verifier, 1)


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

    def __post_init__(self) -> None:
        if self.context_tokens < 0:
            raise InvalidArgumentError("context_tokens must be >= 0")
        if self.max_draft_tokens < 1:
            raise InvalidArgumentError("max_draft_tokens must be >= 1")
        validate_acceptance(self.acceptance)


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
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        accepted = sum(mid**i for i in range(1, k + 1))  # expected accepted of k drafted
        low, high = (mid, high) if accepted / k < rate else (low, mid)
    return (low + high) / 2


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
