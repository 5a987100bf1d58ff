"""Frames and entries between routers and replicas over a window, per generated token, and how
full the verifier's steps were.

Each replica counts what its Frames streams carried since it started (`ReplicaStats`:
`frames_received`, `entries_received`, `frames_sent`, `results_sent`) and the steps its
engine ran (`EngineStats.steps`). `read_traffic` asks every live replica for them (its unary
Stats RPC, with the cluster secret); `traffic_per_token` turns two readings into figures per
generated token, summed per side: frames each way, entries (the calls they carried), and
results per frame sent (how many sessions one engine step answered at once). A replica that
appeared during the window counts from 0; one that went is left out of the second reading, so
its frames are not counted (a killed replica's last frames are lost with it).

A replica that serves no Frames stream (an older version) reports 0 frames.

Step occupancy (`occupancy`, per side): of the sessions running on a replica at each engine step
(advancing on their own: `Engine.keep_running`), the share the step carried, summed over the
window's steps (`EngineStats.running_stepped` over `running_sessions`); beside it the mean
number running (`running_per_step`) and carried (`stepped_per_step`) per step. 1.0 means every
running session was in every step: the device never waited on the router.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cluster.routing.grpc_drafter import GrpcDrafter
from cluster.routing.grpc_verifier import GrpcVerifier
from cluster.runtime.errors import TandemError

COUNTERS = (
    "frames_received",
    "entries_received",
    "frames_sent",
    "results_sent",
    "steps",
    "running_sessions",
    "running_stepped",
)
ENGINE_COUNTERS = ("steps", "running_sessions", "running_stepped")
"""Of `COUNTERS`, those the replica's engine keeps (`EngineStats`)."""
SIDES = ("drafter", "verifier")
STATS_TIMEOUT_S = 5.0

Reading = dict[str, dict[str, int]]
"""Replica id -> its counters (and its side under "side")."""


def read_traffic(replicas: Callable[[], Sequence[dict[str, Any]]], secret: str | None) -> Reading:
    """Every live replica's counters now; a replica that does not answer is left out."""
    reading: Reading = {}
    for entry in replicas():
        side = entry.get("side")
        if side not in SIDES or not entry.get("address"):
            continue
        client_class = GrpcVerifier if side == "verifier" else GrpcDrafter
        try:
            with client_class(entry["address"], timeout_s=STATS_TIMEOUT_S, secret=secret) as client:
                stats = client.stats()
        except TandemError:
            continue
        counters = {
            name: int(getattr(stats, name, 0)) for name in COUNTERS if name not in ENGINE_COUNTERS
        }
        engine = stats.engine
        for name in ENGINE_COUNTERS:
            counters[name] = int(getattr(engine, name)) if engine is not None else 0
        reading[str(entry["replica_id"])] = {"side": SIDES.index(side), **counters}
    return reading


def traffic_per_token(
    before: Mapping[str, Mapping[str, int]], after: Mapping[str, Mapping[str, int]], tokens: int
) -> dict[str, dict[str, float | None]]:
    """Per side: each counter's growth over the window per generated token, and results per
    frame sent (None where nothing was sent)."""
    out: dict[str, dict[str, float | None]] = {}
    for index, side in enumerate(SIDES):
        grown = dict.fromkeys(COUNTERS, 0)
        for replica, counters in after.items():
            if counters["side"] != index:
                continue
            start = before.get(replica, {})
            for name in COUNTERS:
                grown[name] += counters[name] - start.get(name, 0)
        figures: dict[str, float | None] = {
            f"{name}_per_token": (grown[name] / tokens if tokens else None) for name in COUNTERS
        }
        sent, steps, running = grown["frames_sent"], grown["steps"], grown["running_sessions"]
        figures["results_per_frame"] = grown["results_sent"] / sent if sent else None
        figures["frames_sent_per_step"] = sent / steps if steps else None
        figures["occupancy"] = grown["running_stepped"] / running if running else None
        figures["running_per_step"] = running / steps if steps else None
        figures["stepped_per_step"] = grown["running_stepped"] / steps if steps else None
        out[side] = figures
    return out


def traffic_line(per_token: Mapping[str, Mapping[str, float | None]]) -> str:
    """One line for a progress message: frames each way per token, per side."""
    parts = []
    for side, figures in per_token.items():
        received, sent = figures["frames_received_per_token"], figures["frames_sent_per_token"]
        if received is None or sent is None:
            continue
        part = f"{side} frames/token in {received:.3f} out {sent:.3f}"
        occupancy, running = figures.get("occupancy"), figures.get("running_per_step")
        if occupancy is not None and running is not None:
            part += f", step occupancy {occupancy:.3f} of {running:.1f} running"
        parts.append(part)
    return "; ".join(parts) if parts else "no replica traffic read"
