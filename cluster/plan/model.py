"""The planning math: expected tokens/s and ITL of a load, by drafter kind and block length,
with the host's CPU in the loop. Pure functions of `cluster.plan.inputs` objects; no I/O.

A stream's token goes round a closed loop: the device (its share of a round's verify pass and,
where drafting does not overlap it, the drafted block, plus its share of its request's
prefill: `PlanInputs.prefill_s_per_generated_token`), a wait outside any core (hops,
wake-ups: `latency_ms_per_round` over the round's tokens) and the host's cores, where every
token costs `HostCost.cpu_ms` (less at larger batches and longer rounds). The device part is
the analytic ideal of `cluster.runtime.sim.ideal_rates` (serial rounds, or the better of
serial and pipelined ones where the draft is made off the verifier's device) at the streams
each verifier holds. The host is a queue of c cores, solved by exact mean value analysis over
Seidmann's approximation (a c-core queue of demand D as a one-core queue of demand D / c plus
a delay of D (c - 1) / c): with N streams, each with delay Z a token,

    R(n) = D / c x (1 + Q(n - 1)),  X(n) = n / (Z + D (c - 1) / c + R(n)),  Q(n) = X(n) R(n)

so one stream sees Z + D a token, and many streams tend to X = c / D, the host's cap: at 16
and 64 streams the simulated service on two cores is CPU-bound, which the ideal alone misses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.plan.inputs import TARGET_ALONE, DrafterCost, HostCost, PlanInputs, RouterCost
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.sim import expected_tokens, ideal_rates
from cluster.runtime.sim_source import DeviceProfile

MAX_CLIENTS = 1024
"""The most streams a verifier is searched over (`clients_per_verifier`)."""
SATURATION_SHARE = 0.9
"""A verifier is saturated at the fewest streams reaching this share of its rate at
`MAX_CLIENTS`."""
MIN_GAIN = 1.01
"""Speculate only where it beats the target alone by this factor: where both are bound by the
host's cores they tie, and the plan keeps the simpler service."""
MS = 1e-3


@dataclass(frozen=True)
class Estimate:
    """One kind at one block length under one load."""

    kind: str
    draft_tokens: int
    alpha: float
    tokens_per_s: float
    """Aggregate over every stream of every verifier."""
    itl_ms: float
    """Mean ms between a stream's tokens: clients / tokens_per_s."""
    device_tokens_per_s: float
    """The device's ideal alone (no host cost), aggregate."""
    tokens_per_round: float
    drafter_load: float
    """Drafter replicas' worth of work per verifier (`drafter_load`); 0 where no replica drafts."""
    capacity_factor: float | None
    """1 + k t_d / t_v: a verifier's capacity over drafting on its own device (Speculation at a
    Distance), for drafts made on a device of their own; None elsewhere."""
    cpu_ms_per_token: float = 0.0
    """The host's CPU a generated token (`HostCost.cpu_ms`, plus a CPU drafter's lookups)."""
    router_load: float = 0.0
    """Router processes' worth of work to keep one verifier's device fed (`router_load`)."""

    @property
    def drafters_per_verifier(self) -> int:
        return math.ceil(self.drafter_load - 1e-9) if self.drafter_load > 0 else 0

    @property
    def routers_per_verifier(self) -> int:
        """Router replicas (one Python process each) a verifier needs; at least one."""
        return max(1, math.ceil(self.router_load - 1e-9))


def draft_step_profile(cost: DrafterCost, k: int, target: DeviceProfile) -> DeviceProfile:
    """The one-step cost whose k-fold is a block's time at batch N, so that `ideal_rates` prices
    every kind: a drafter's own device; `target_ratio` of the target's step; or
    (hop + N x cpu_per_round) / k for a CPU drafter serving its N streams in turn."""
    if cost.placement == "own_device":
        assert cost.device is not None  # checked when the cost was built
        return cost.device
    if cost.placement == "verifier_device":
        r = cost.target_ratio
        return DeviceProfile(r * target.base_s, r * target.per_token_s, r * target.per_context_s)
    if cost.placement == "host_cpu":
        return DeviceProfile(cost.hop_ms * MS / k, cost.cpu_ms_per_round * MS / k, 0.0)
    raise InvalidArgumentError(f"{cost.kind}: no drafted block to price")


def closed_loop_rate(
    streams: int, delay_s: float, cpu_s: float, cores: float, critical_share: float = 1.0
) -> float:
    """Tokens/s of `streams` streams, each token spending `delay_s` off the cores and `cpu_s` on
    one of `cores` cores (exact MVA over Seidmann's approximation; the module docstring).

    Only `critical_share` of the CPU lies on a token's own path (its round's frames, verify and
    commit); the rest (streaming it out, the load client, the service's background) loads the
    cores without delaying the round. The loop then sees the cores that work leaves,
    c' = c - X (1 - share) cpu_s, at the rate X it reaches with them: the fixed point, found by
    bisection (the loop's rate falls as X grows). With the whole CPU critical it is the plain
    loop; either way many streams tend to c / cpu_s."""
    if streams < 1:
        return 0.0
    if delay_s + cpu_s <= 0:
        return math.inf
    critical_s, other_s = cpu_s * critical_share, cpu_s * (1.0 - critical_share)
    if other_s <= 0:
        return _mva_rate(streams, delay_s, critical_s, cores)
    low, high = 0.0, cores / cpu_s
    for _ in range(60):
        rate = (low + high) / 2
        left = cores - rate * other_s
        reached = _mva_rate(streams, delay_s, critical_s, left) if left > 0 else 0.0
        low, high = (rate, high) if reached > rate else (low, rate)
    return (low + high) / 2


def _mva_rate(streams: int, delay_s: float, cpu_s: float, cores: float) -> float:
    if cpu_s <= 0:
        return streams / delay_s
    queue_s, spread_s = cpu_s / cores, cpu_s * max(cores - 1, 0.0) / cores
    waiting, rate = 0.0, 0.0
    for n in range(1, streams + 1):
        response_s = queue_s * (1.0 + waiting)
        rate = n / (delay_s + spread_s + response_s)
        waiting = rate * response_s
    return rate


def estimate(
    inputs: PlanInputs,
    kind: str,
    alpha: float,
    draft_tokens: int,
    clients: int,
    verifiers: int = 1,
    host: HostCost | None = None,
    drafting_share: float = 1.0,
) -> Estimate:
    """Tokens/s and ITL of `clients` streams spread over `verifiers` verifiers (sharing one
    host) drafting `draft_tokens` a round with `kind` at acceptance `alpha` (`none`: the target
    alone, k = 0). `host` overrides `inputs.host`. `drafting_share`: the share of rounds that
    draft at all, whose host CPU the drafting costs (a measured run's gate drafts in some)."""
    if clients < 1 or verifiers < 1:
        raise InvalidArgumentError(
            f"clients and verifiers must be >= 1, got {clients}, {verifiers}"
        )
    host = host or inputs.host
    per_verifier = math.ceil(clients / verifiers)
    k = 0 if kind == TARGET_ALONE else draft_tokens
    if k < 0:
        raise InvalidArgumentError(f"draft_tokens must be >= 0, got {draft_tokens}")
    context = inputs.context_tokens
    cost = inputs.drafters.get(kind) if k else None
    if k and cost is None:
        raise InvalidArgumentError(f"no cost figures for drafter kind {kind!r}")
    if cost is None:
        rates = ideal_rates(inputs.target, inputs.target, 0.0, 0, per_verifier, context, 0)
        device_rate, per_round = rates.target_only, 1.0
    else:
        draft = draft_step_profile(cost, k, inputs.target)
        rates = ideal_rates(inputs.target, draft, alpha, k, per_verifier, context, 0)
        device_rate = max(rates.serial, rates.pipelined) if cost.overlaps_verify else rates.serial
        per_round = expected_tokens(alpha, k)
    # Prefills share the device with the rounds: their time a generated token adds to a
    # token's device time at every batch (chunks of prompt cost the marginal token's price).
    device_rate = 1.0 / (1.0 / device_rate + inputs.prefill_s_per_generated_token(cost))
    delay_s = per_verifier / device_rate + host.latency_ms_per_round * MS / per_round
    cpu_s = host.cpu_ms(per_verifier, per_round) * MS
    if cost is not None:
        cpu_s += drafting_share * cost.host_cpu_ms_per_round(k) * MS / per_round
    rate = closed_loop_rate(clients, delay_s, cpu_s, host.usable_cores, host.critical_share)
    capacity, load = None, 0.0
    if cost is not None:
        load = drafter_load(cost, rate / verifiers, per_verifier, per_round, rates.draft_block_s)
        if cost.placement == "own_device":
            capacity = 1.0 + rates.draft_block_s / rates.verify_s
    return Estimate(
        kind=kind,
        draft_tokens=k,
        alpha=alpha if k else 0.0,
        tokens_per_s=rate,
        itl_ms=clients / rate / MS,
        device_tokens_per_s=device_rate * verifiers,
        tokens_per_round=per_round,
        drafter_load=load,
        capacity_factor=capacity,
        cpu_ms_per_token=cpu_s / MS,
        router_load=router_load(inputs.router, device_rate, per_round if k else None),
    )


def router_load(
    cost: RouterCost, device_tokens_per_s: float, tokens_per_round: float | None
) -> float:
    """Router processes' worth of work to keep up with one verifier's device committing
    `device_tokens_per_s` (its ideal, not what the host lets through: the routers must not be
    what holds the device back): each committed token costs a router `cpu_ms_per_token`, each
    drafting round (`tokens_per_round` tokens; None: the target alone) `cpu_ms_per_round`
    more, and one router process has `core_share` of a core to give (its event loop is one
    thread, and its gRPC threads take their share of the same interpreter)."""
    per_token_ms = cost.cpu_ms_per_token
    if tokens_per_round is not None:
        per_token_ms += cost.cpu_ms_per_round / max(tokens_per_round, 1.0)
    return device_tokens_per_s * per_token_ms * MS / cost.core_share


def drafter_load(
    cost: DrafterCost,
    tokens_per_s: float,
    streams: int,
    tokens_per_round: float,
    draft_block_s: float,
) -> float:
    """Drafter replicas' worth of work for one verifier committing `tokens_per_s` over `streams`
    streams: the busier of a replica's device and its one core.

    - device (`own_device`): batched blocks a second x a block's time,
      tokens_per_s / (streams x E) x draft_block_s;
    - core: tokens_per_s x replica_cpu_ms_per_token, plus for a CPU drafter its lookups,
      tokens_per_s / E x cpu_ms_per_round.
    A verifier's own draft (`verifier_device`) needs no replica: 0."""
    if cost.placement in ("verifier_device", "none"):
        return 0.0
    core = tokens_per_s * cost.replica_cpu_ms_per_token * MS
    if cost.placement == "host_cpu":
        return core + tokens_per_s / tokens_per_round * cost.cpu_ms_per_round * MS
    device = tokens_per_s / (streams * tokens_per_round) * draft_block_s
    return max(device, core)


def best_estimate(
    inputs: PlanInputs,
    category: str,
    clients: int,
    verifiers: int = 1,
    host: HostCost | None = None,
    kinds: tuple[str, ...] | None = None,
) -> Estimate:
    """The kind and k (1..max_draft_tokens) with the most tokens/s for `category` at this load,
    among the kinds with an acceptance figure for it (or `kinds`); the target alone unless one
    beats it by `MIN_GAIN`."""
    by_kind = inputs.acceptance.get(category)
    if by_kind is None:
        known = ", ".join(inputs.acceptance)
        raise InvalidArgumentError(f"no acceptance figures for {category!r}; known: {known}")
    alone = estimate(inputs, TARGET_ALONE, 0.0, 0, clients, verifiers, host)
    best = alone
    for kind, alpha in by_kind.items():
        if kind == TARGET_ALONE or (kinds is not None and kind not in kinds):
            continue
        for k in range(1, inputs.max_draft_tokens + 1):
            candidate = estimate(inputs, kind, alpha, k, clients, verifiers, host)
            if candidate.tokens_per_s > best.tokens_per_s:
                best = candidate
    return best if best.tokens_per_s >= MIN_GAIN * alone.tokens_per_s else alone


def clients_per_verifier(
    inputs: PlanInputs,
    kind: str,
    alpha: float,
    draft_tokens: int,
    itl_ms: float | None = None,
    host: HostCost | None = None,
) -> int:
    """Streams one verifier serves: the most whose ITL stays within `itl_ms` (0 if one stream
    already misses it), or, without a target, the fewest reaching `SATURATION_SHARE` of its
    tokens/s at `MAX_CLIENTS` streams. Both searches are binary: ITL and tokens/s grow with
    the streams."""

    def at(n: int) -> Estimate:
        return estimate(inputs, kind, alpha, draft_tokens, n, 1, host)

    if itl_ms is not None:
        if itl_ms <= 0:
            raise InvalidArgumentError(f"the target ITL must be > 0 ms, got {itl_ms}")
        if at(1).itl_ms > itl_ms:
            return 0
        low, high = 1, MAX_CLIENTS
        while low < high:  # the largest n with itl(n) <= itl_ms
            mid = (low + high + 1) // 2
            low, high = (mid, high) if at(mid).itl_ms <= itl_ms else (low, mid - 1)
        return low
    ceiling = SATURATION_SHARE * at(MAX_CLIENTS).tokens_per_s
    low, high = 1, MAX_CLIENTS
    while low < high:  # the smallest n with rate(n) >= ceiling
        mid = (low + high) // 2
        low, high = (mid + 1, high) if at(mid).tokens_per_s < ceiling else (low, mid)
    return low


def mixed_tokens_per_s(rates: list[float]) -> float:
    """Aggregate tokens/s of a load that is an equal share of tokens from each category: a
    token's mean time is the mean of theirs, 1 / X = mean(1 / X_c)."""
    if not rates or any(r <= 0 for r in rates):
        raise InvalidArgumentError("mixing needs positive rates")
    return len(rates) / sum(1.0 / r for r in rates)
