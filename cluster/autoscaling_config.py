"""How Serve scales one side on the load its replicas report (`AutoscalingConfig`), and the
policy's default targets.

Plain data, validated when built, no I/O: stdlib and `cluster.runtime.errors` only. The policy
Serve runs is `cluster.serve.autoscaling` (`POLICY_PATH` names it, a string: this module does
not import it, so a config is read without `cluster.serve`); it takes its default targets from
here, so that both sides agree on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cluster.runtime.errors import InvalidArgumentError

POLICY_PATH = "cluster.serve.autoscaling:scale_on_load"
"""What a deployment's `autoscaling_config.policy.policy_function` names."""
DEFAULT_TARGET_SESSIONS = 16.0
DEFAULT_TARGET_BUSY = 0.7
DEFAULT_MAX_KV_USED = 0.85
"""Above this share of its KV pool in use a replica is saturated: the sessions it holds grow
into the rest, and a new one may find no room."""
DEFAULT_TARGET_QUEUE_WAIT_S = 0.5
"""A call that waits longer than this for a step is queued behind full batches, not behind one
step in progress (a step of the models Tandem serves takes milliseconds to a few tenths)."""


@dataclass(frozen=True)
class AutoscalingConfig:
    """Serve autoscaling of one side on the load its replicas report (cluster/serve/autoscaling.py):
    enough replicas that neither open sessions nor busy fraction per replica exceeds its
    target, a replica whose engine's KV pool is nearly full or whose calls queue too long
    counting as fully busy. Off by default: the group runs `num_replicas`. On, Serve starts
    `min_replicas` and `num_replicas` is not used."""

    enabled: bool = False
    min_replicas: int = 1
    """At least 1: a side with no replica has no load to report, so nothing would scale it up."""
    max_replicas: int = 4
    target_sessions: float = DEFAULT_TARGET_SESSIONS
    """Open sessions per replica (each holds a KV cache)."""
    target_busy: float = DEFAULT_TARGET_BUSY
    """Share of time each replica's model spends computing, in (0, 1]."""
    max_kv_used: float = DEFAULT_MAX_KV_USED
    """Share of a replica's KV pool in use above which it counts as fully busy, in (0, 1]."""
    target_queue_wait_s: float = DEFAULT_TARGET_QUEUE_WAIT_S
    """Seconds a call may wait for its replica's engine before the replica counts as fully
    busy."""
    upscale_delay_s: float = 10.0
    """How long more replicas must be wanted before they are started."""
    downscale_delay_s: float = 120.0
    """How long fewer replicas must be wanted before one is stopped (it drains first)."""
    look_back_period_s: float = 30.0
    """Window over which Serve averages each replica's reported load (Serve's default)."""
    metrics_interval_s: float = 10.0
    """How often replicas push their load to Serve's controller, less than look_back_period_s
    (Serve's default; lower both for a faster reaction)."""

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise InvalidArgumentError(f"min_replicas must be >= 1, got {self.min_replicas}")
        if self.max_replicas < self.min_replicas:
            raise InvalidArgumentError(
                f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})"
            )
        # The same rule as the policy's own `check_targets`, which Serve's controller applies
        # to `policy_kwargs` (the policy cannot share this one: see cluster/serve/autoscaling.py).
        if not self.target_sessions > 0:
            raise InvalidArgumentError(f"target_sessions must be > 0, got {self.target_sessions}")
        for name in ("target_busy", "max_kv_used"):
            if not 0 < getattr(self, name) <= 1:
                raise InvalidArgumentError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if not self.target_queue_wait_s > 0:
            raise InvalidArgumentError(
                f"target_queue_wait_s must be > 0, got {self.target_queue_wait_s}"
            )
        for name in ("upscale_delay_s", "downscale_delay_s"):
            if not getattr(self, name) >= 0:
                raise InvalidArgumentError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("look_back_period_s", "metrics_interval_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgumentError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.look_back_period_s > self.metrics_interval_s:
            raise InvalidArgumentError(
                f"look_back_period_s ({self.look_back_period_s}) must be greater "
                f"than metrics_interval_s ({self.metrics_interval_s})"
            )

    def serve_options(self) -> dict[str, Any]:
        """Serve's `autoscaling_config` for the deployment."""
        return {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "look_back_period_s": self.look_back_period_s,
            "metrics_interval_s": self.metrics_interval_s,
            "policy": {
                "policy_function": POLICY_PATH,
                "policy_kwargs": {
                    "target_sessions": self.target_sessions,
                    "target_busy": self.target_busy,
                    "max_kv_used": self.max_kv_used,
                    "target_queue_wait_s": self.target_queue_wait_s,
                },
            },
        }
