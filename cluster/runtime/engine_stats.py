"""What a replica's batching engine reports about itself: a plain snapshot, no I/O.

`EngineStats` travels in `ReplicaStats` (the Stats RPC), in every heartbeat (`ReplicaInfo`), in
`tandem status --json` (one `engine` object per replica) and in the Prometheus metrics; the
autoscaler reads its queue wait and KV use.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class EngineStats:
    """A replica engine's counters since start and gauges of now."""

    runner: str = "paged"
    """How forward passes run: `paged` (one batched pass over the paged KV pool), `serial`
    (the fallback for models whose attention cannot be swapped: one session at a time) or
    `sim` (a simulated device)."""
    steps: int = 0
    """Forward passes run since start."""
    max_batch_sequences: int = 0
    """The most sessions in one forward pass since start."""
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    block_size: int = 0
    """Tokens per KV block."""
    batch_sequences: float = 0.0
    """Sessions per forward pass, smoothed over recent steps."""
    step_tokens: float = 0.0
    """Tokens per forward pass, smoothed over recent steps."""
    queue_wait_s: float = 0.0
    """Seconds a call waited before a step took it, smoothed over recent calls."""
    queued: int = 0
    """Calls waiting for a step now."""
    cost_base_s: float = 0.0
    cost_per_token_s: float = 0.0
    """The measured step cost curve: seconds = cost_base_s + cost_per_token_s x tokens."""
    busy_s: float = 0.0
    """Seconds spent in steps since start."""
    forward_s: float = 0.0
    """Seconds of those in the runner's forward passes."""
    device_s: float = 0.0
    """Seconds of device time in the forward passes: the modelled time of a simulated device
    (`cluster.runtime.sim`), else the same as `forward_s`."""
    batched_s: float = 0.0
    """Seconds in Batched handlers after steps (a verifier's batched acceptance)."""
    gather_s: float = 0.0
    """Seconds spent waiting for sessions about to come back before steps."""
    gathers: int = 0
    """Steps that waited for such sessions."""
    preemptions: int = 0
    """Sessions whose KV blocks were freed for an older session's growth (since start)."""
    recomputed_tokens: int = 0
    """Tokens run again to rebuild the KV that preemptions freed (since start)."""
    refusals: int = 0
    """Calls refused for lack of KV memory (since start): sessions refused at admission, and
    work that could not fit in the whole pool."""

    running_sessions: int = 0
    """Sessions advancing on their own (`Engine.keep_running`), summed over steps."""
    running_stepped: int = 0
    """Of those, the ones each step carried, summed over steps: `occupancy` is the ratio."""
    startup_base_s: float = 0.0
    startup_per_token_s: float = 0.0
    """The step cost curve as measured at start-up, before serving (`Engine.calibrate`); 0
    where it was not measured."""
    step_running_s: float = 0.0
    """Seconds the step running now has taken so far (0: none is running)."""

    @property
    def startup_step_s(self) -> float:
        """Seconds of a one-token step as measured at start-up (0: not measured)."""
        return self.startup_base_s + self.startup_per_token_s

    @property
    def occupancy(self) -> float | None:
        """The share of running sessions the steps carried (None: no step had any)."""
        if self.running_sessions == 0:
            return None
        return self.running_stepped / self.running_sessions

    @property
    def kv_blocks_free(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_used

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineStats:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})
