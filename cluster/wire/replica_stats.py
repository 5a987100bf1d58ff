"""A replica's stats on the wire: `ReplicaStats` and its engine's `EngineStats` <-> their
`protos/replica.proto` messages (the Stats call's answer).

Contract: every counter must fit its unsigned field or `*_to_wire` refuses it, naming the
figure (`InvalidArgumentError`); an unset `engine` (no engine runs, or an older replica) reads
back as None. Every figure of `EngineStats` has a field of its own.
"""

from __future__ import annotations

from cluster.runtime.engine_stats import EngineStats
from cluster.runtime.session import ReplicaStats
from cluster.wire.fields import MAX_UINT32, uint_to_wire
from protos import replica_pb2


def engine_stats_to_wire(engine: EngineStats) -> replica_pb2.EngineStats:
    return replica_pb2.EngineStats(
        runner=engine.runner,
        steps=uint_to_wire(engine.steps, "engine.steps"),
        max_batch_sequences=uint_to_wire(
            engine.max_batch_sequences, "engine.max_batch_sequences", MAX_UINT32
        ),
        kv_blocks_total=uint_to_wire(engine.kv_blocks_total, "engine.kv_blocks_total"),
        kv_blocks_used=uint_to_wire(engine.kv_blocks_used, "engine.kv_blocks_used"),
        block_size=uint_to_wire(engine.block_size, "engine.block_size", MAX_UINT32),
        batch_sequences=engine.batch_sequences,
        step_tokens=engine.step_tokens,
        queue_wait_s=engine.queue_wait_s,
        queued=uint_to_wire(engine.queued, "engine.queued", MAX_UINT32),
        cost_base_s=engine.cost_base_s,
        cost_per_token_s=engine.cost_per_token_s,
        busy_s=engine.busy_s,
        forward_s=engine.forward_s,
        device_s=engine.device_s,
        batched_s=engine.batched_s,
        gather_s=engine.gather_s,
        gathers=uint_to_wire(engine.gathers, "engine.gathers"),
        preemptions=uint_to_wire(engine.preemptions, "engine.preemptions"),
        recomputed_tokens=uint_to_wire(engine.recomputed_tokens, "engine.recomputed_tokens"),
        refusals=uint_to_wire(engine.refusals, "engine.refusals"),
        running_sessions=uint_to_wire(engine.running_sessions, "engine.running_sessions"),
        running_stepped=uint_to_wire(engine.running_stepped, "engine.running_stepped"),
        startup_base_s=engine.startup_base_s,
        startup_per_token_s=engine.startup_per_token_s,
        step_running_s=engine.step_running_s,
    )


def engine_stats_from_wire(message: replica_pb2.EngineStats) -> EngineStats:
    return EngineStats(
        runner=message.runner,
        steps=message.steps,
        max_batch_sequences=message.max_batch_sequences,
        kv_blocks_total=message.kv_blocks_total,
        kv_blocks_used=message.kv_blocks_used,
        block_size=message.block_size,
        batch_sequences=message.batch_sequences,
        step_tokens=message.step_tokens,
        queue_wait_s=message.queue_wait_s,
        queued=message.queued,
        cost_base_s=message.cost_base_s,
        cost_per_token_s=message.cost_per_token_s,
        busy_s=message.busy_s,
        forward_s=message.forward_s,
        device_s=message.device_s,
        batched_s=message.batched_s,
        gather_s=message.gather_s,
        gathers=message.gathers,
        preemptions=message.preemptions,
        recomputed_tokens=message.recomputed_tokens,
        refusals=message.refusals,
        running_sessions=message.running_sessions,
        running_stepped=message.running_stepped,
        startup_base_s=message.startup_base_s,
        startup_per_token_s=message.startup_per_token_s,
        step_running_s=message.step_running_s,
    )


def stats_to_wire(stats: ReplicaStats) -> replica_pb2.ReplicaStats:
    """An `engine` of None leaves the field unset."""
    message = replica_pb2.ReplicaStats(
        num_sessions=stats.num_sessions,
        num_cached_tokens=stats.num_cached_tokens,
        busy_s=stats.busy_s,
        frames_sent=uint_to_wire(stats.frames_sent, "frames_sent"),
        results_sent=uint_to_wire(stats.results_sent, "results_sent"),
        frames_received=uint_to_wire(stats.frames_received, "frames_received"),
        entries_received=uint_to_wire(stats.entries_received, "entries_received"),
        sessions_expired=uint_to_wire(stats.sessions_expired, "sessions_expired"),
        sessions_evicted=uint_to_wire(stats.sessions_evicted, "sessions_evicted"),
    )
    if stats.engine is not None:
        message.engine.CopyFrom(engine_stats_to_wire(stats.engine))
    return message


def stats_from_wire(message: replica_pb2.ReplicaStats) -> ReplicaStats:
    """An unset `engine` (no engine runs, or an older replica) reads back as None."""
    return ReplicaStats(
        num_sessions=message.num_sessions,
        num_cached_tokens=message.num_cached_tokens,
        busy_s=message.busy_s,
        engine=engine_stats_from_wire(message.engine) if message.HasField("engine") else None,
        frames_sent=message.frames_sent,
        results_sent=message.results_sent,
        frames_received=message.frames_received,
        entries_received=message.entries_received,
        sessions_expired=message.sessions_expired,
        sessions_evicted=message.sessions_evicted,
    )
