"""Router results <-> `tandem.v1` public messages: finish reasons and speculation counters.

The one place that knows how the router's `FinishReason` and `SpeculationStats` are laid out on
the public wire (as `cluster.wire.convert` is for the replicas' API); pure, with round-trip
tests in tests/cluster/api/test_service.py.
"""

from __future__ import annotations

from cluster.routing.request import FinishReason, SpeculationStats
from protos import generate_pb2

_FINISH_REASON_PREFIX = "FINISH_REASON_"


def finish_reason_to_proto(reason: FinishReason) -> generate_pb2.FinishReason:
    # The proto enum names are the Python enum's names with a prefix: one list of reasons.
    return generate_pb2.FinishReason.Value(_FINISH_REASON_PREFIX + reason.name)


def finish_reason_from_proto(value: generate_pb2.FinishReason) -> FinishReason | None:
    """None for FINISH_REASON_UNSPECIFIED (not finished)."""
    if value == generate_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    return FinishReason[generate_pb2.FinishReason.Name(value).removeprefix(_FINISH_REASON_PREFIX)]


def stats_to_proto(stats: SpeculationStats) -> generate_pb2.SpeculationStats:
    return generate_pb2.SpeculationStats(
        num_drafted=stats.num_drafted,
        num_accepted=stats.num_accepted,
        num_verify_passes=stats.num_verify_passes,
        pipeline_hits=stats.pipeline_hits,
        pipeline_misses=stats.pipeline_misses,
        drafted_by_position=stats.drafted_by_position,
        accepted_by_position=stats.accepted_by_position,
    )


def stats_from_proto(message: generate_pb2.SpeculationStats) -> SpeculationStats:
    return SpeculationStats(
        num_drafted=message.num_drafted,
        num_accepted=message.num_accepted,
        num_verify_passes=message.num_verify_passes,
        pipeline_hits=message.pipeline_hits,
        pipeline_misses=message.pipeline_misses,
        drafted_by_position=list(message.drafted_by_position),
        accepted_by_position=list(message.accepted_by_position),
    )
