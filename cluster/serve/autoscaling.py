"""Scaling drafters and verifiers on their real load: open sessions, busy time, KV and queueing.

Blocks bypass Serve (docs/architecture.md, invariant 4), so Serve's request counts see no load on
the Drafter and Verifier deployments. Each replica reports its own instead, through Serve's custom
metrics hook (`ReplicaShell.record_autoscaling_stats`, cluster/replica/host.py): `sessions`
open, `busy` (the share of the last second its model spent computing), `queue` (calls
waiting for it), and from its batching engine `kv_used` (the share of its KV pool in use) and
`queue_wait_s` (how long a call waits before a step takes it). Serve averages each per replica
over `look_back_period_s` and calls the deployment's policy, `scale_on_load`, every control-loop
tick. Each side is its own deployment with its own policy instance and limits, so drafters and
verifiers scale apart.

The rule (`desired_replicas`): enough replicas that neither the sessions per replica nor the
busy fraction per replica exceeds its target,

    replicas = ceil(max(total sessions / target_sessions, total busy / target_busy)),

clamped to [min, max]. Sessions measure memory and pinning (each holds a KV cache); busy time
measures compute, which sessions alone miss (long prompts, long blocks, a slow model).

A batching engine hides saturation from busy time: a replica computing all the time may still
take more sessions into each step, and one whose KV pool is full cannot, however idle. So a
replica whose KV pool is nearly full (`kv_used` above `max_kv_used`) or whose calls wait longer
than `target_queue_wait_s` counts as saturated: its busy fraction counts as 1.0, as if it
computed all the time (`saturated_busy`). A replica without an engine reports 0 for both.

Contract with Ray Serve (2.60, read from `ray/serve/_private/autoscaling_state.py`):
`policy_function` is an import path; when it names a class, Serve instantiates it once with
`policy_kwargs` and calls the instance with an `AutoscalingContext` on every tick, expecting
`(replicas, policy_state)`. Serve ignores `policy_kwargs` for a plain function, which is why
`scale_on_load` is a class. Serve wraps every custom policy: a decision must hold for
`upscale_delay_s` / `downscale_delay_s` before it is acted on (so a dip in load does not stop
replicas at once), and the result is clamped to the deployment's bounds.

No Ray or torch here, and from the project only numbers: Serve pickles this module by value into
its controller, where the project may not be importable. The default targets come from the
config (`cluster.autoscaling_config`, which names this policy by `POLICY_PATH`): they are floats,
pickled by value into the defaults of the functions below. A function or class taken from
another module would be pickled by reference and imported in the controller, which is why
`check_targets` is this module's own (the config applies the same rule when it is built).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster.autoscaling_config import (
    DEFAULT_MAX_KV_USED,
    DEFAULT_TARGET_BUSY,
    DEFAULT_TARGET_QUEUE_WAIT_S,
    DEFAULT_TARGET_SESSIONS,
)

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

# Metric names, as `ReplicaInfo.autoscaling_stats` reports them.
SESSIONS = "sessions"
BUSY = "busy"
QUEUE = "queue"
KV_USED = "kv_used"
QUEUE_WAIT = "queue_wait_s"
SATURATED_BUSY = 1.0
"""The busy fraction a saturated replica counts as: all of one replica's compute."""
ROUNDING_SLACK = 1e-6
"""Averaged loads carry float noise: 4 sessions over a target of 2 must ask for 2 replicas,
not 3 because the average came out 4.0000001."""


@dataclass(frozen=True)
class Load:
    """A deployment's load, summed over its replicas."""

    sessions: float
    """Open sessions."""
    busy: float
    """Busy fractions (1.0: one replica's worth of compute, busy all the time)."""


def desired_replicas(
    load: Load, target_sessions: float, target_busy: float, min_replicas: int, max_replicas: int
) -> int:
    """Replicas needed to keep sessions and busy fraction per replica at their targets or
    below, within [min_replicas, max_replicas]."""
    need = max(load.sessions / target_sessions, load.busy / target_busy)
    return max(min_replicas, min(max_replicas, math.ceil(need - ROUNDING_SLACK)))


def saturated_busy(
    busy: float,
    kv_used: float,
    queue_wait_s: float,
    max_kv_used: float = DEFAULT_MAX_KV_USED,
    target_queue_wait_s: float = DEFAULT_TARGET_QUEUE_WAIT_S,
) -> float:
    """One replica's busy fraction as the rule counts it: `SATURATED_BUSY` when its KV pool is
    nearly full or its calls wait past the target, else as reported."""
    if kv_used > max_kv_used or queue_wait_s > target_queue_wait_s:
        return max(busy, SATURATED_BUSY)
    return busy


def check_targets(
    target_sessions: float,
    target_busy: float,
    max_kv_used: float = DEFAULT_MAX_KV_USED,
    target_queue_wait_s: float = DEFAULT_TARGET_QUEUE_WAIT_S,
) -> None:
    """Raise ValueError unless the targets can be used (Serve's controller reports it)."""
    if not target_sessions > 0:
        raise ValueError(f"target_sessions must be > 0, got {target_sessions}")
    if not 0 < target_busy <= 1:
        raise ValueError(f"target_busy must be in (0, 1], got {target_busy}")
    if not 0 < max_kv_used <= 1:
        raise ValueError(f"max_kv_used must be in (0, 1], got {max_kv_used}")
    if not target_queue_wait_s > 0:
        raise ValueError(f"target_queue_wait_s must be > 0, got {target_queue_wait_s}")


class ScaleOnLoad:
    """Serve's autoscaling policy for one deployment of replicas that report `sessions`,
    `busy` and, with an engine, `kv_used` and `queue_wait_s` (see the module's docstring for
    the contract)."""

    def __init__(
        self,
        target_sessions: float = DEFAULT_TARGET_SESSIONS,
        target_busy: float = DEFAULT_TARGET_BUSY,
        max_kv_used: float = DEFAULT_MAX_KV_USED,
        target_queue_wait_s: float = DEFAULT_TARGET_QUEUE_WAIT_S,
    ) -> None:
        check_targets(target_sessions, target_busy, max_kv_used, target_queue_wait_s)
        self.target_sessions = target_sessions
        self.target_busy = target_busy
        self.max_kv_used = max_kv_used
        self.target_queue_wait_s = target_queue_wait_s

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        sessions, busy = metrics.get(SESSIONS, {}), metrics.get(BUSY, {})
        if not sessions and not busy:
            # No replica has reported yet (just deployed): hold.
            return ctx.target_num_replicas, dict(ctx.policy_state)
        kv_used, queue_wait = metrics.get(KV_USED, {}), metrics.get(QUEUE_WAIT, {})
        # Per replica, so that one saturated replica counts whole, not diluted by idle ones.
        # A replica missing a metric (an older one, or one that has not reported it yet) is
        # not saturated by it.
        reporting = busy.keys() | kv_used.keys() | queue_wait.keys()
        total_busy = sum(
            saturated_busy(
                busy.get(replica, 0.0),
                kv_used.get(replica, 0.0),
                queue_wait.get(replica, 0.0),
                self.max_kv_used,
                self.target_queue_wait_s,
            )
            for replica in reporting
        )
        load = Load(sessions=sum(sessions.values()), busy=total_busy)
        replicas = desired_replicas(
            load,
            self.target_sessions,
            self.target_busy,
            ctx.capacity_adjusted_min_replicas,
            ctx.capacity_adjusted_max_replicas,
        )
        return replicas, dict(ctx.policy_state)


scale_on_load = ScaleOnLoad
"""The name deployment configs use (`POLICY_PATH`): Serve instantiates it with policy_kwargs."""
