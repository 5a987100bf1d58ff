"""The public `tandem.v1` messages <-> the API's domain types: the gRPC face's one converter.

`TandemService` works on domain types (`cluster.api.request.ApiRequest` in,
`cluster.api.response.ApiChunk` out); only the gRPC face (`cluster.api.grpc_api`, which the
Serve ingress and the test gRPC front serve) speaks protobuf, and this is where its messages
are read and written: requests in (`request_from_proto`), chunks,
responses, usage and audit reports out, and the router's `FinishReason` and
`SpeculationStats` on the public wire (as the `cluster.wire` modules are for the replicas' API).
The OpenAI-compatible face goes from JSON to domain types and back without it.

Pure: reading a request checks only what the wire itself can get wrong (a rule value that is no
`SamplingRule`, sampling settings `SamplingParams` refuses); every other check is the request
reader's (`cluster.api.request_reader`). Round-trip tests in tests/cluster/api/test_service.py.
"""

from __future__ import annotations

from cluster.api.audit import Audited
from cluster.api.request import ApiRequest, Chat, Prompt
from cluster.api.response import ApiChunk
from cluster.api.sampling_rule import rule_from_proto
from cluster.api.tenants import TenantUsage
from cluster.routing.request import FinishReason, SpeculationStats
from cluster.runtime.audit import cause
from cluster.wire.sampling_settings import grammar_from_wire, sampling_from_wire
from protos import generate_pb2

_FINISH_REASON_PREFIX = "FINISH_REASON_"


def request_from_proto(message: generate_pb2.GenerateRequest) -> ApiRequest:
    """The request `message` asks for; unset optional fields are None (the server's)."""
    speculation = message.speculation
    return ApiRequest(
        prompt=prompt_from_proto(message),
        max_tokens=message.max_tokens,
        sampling=sampling_from_wire(message.sampling),
        rule=rule_from_proto(message.sampling.rule),
        seed=message.seed if message.HasField("seed") else None,
        stop=tuple(message.stop),
        draft_tokens=(speculation.draft_tokens if speculation.HasField("draft_tokens") else None),
        pipelined=speculation.pipelined if speculation.HasField("pipelined") else None,
        predraft_fan_out=(
            speculation.predraft_fan_out if speculation.HasField("predraft_fan_out") else None
        ),
        grammar=grammar_from_wire(message.grammar),
        min_tokens=message.min_tokens,
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        skip_special_tokens=(
            message.skip_special_tokens if message.HasField("skip_special_tokens") else True
        ),
    )


def prompt_from_proto(message: generate_pb2.GenerateRequest) -> Prompt:
    """The `prompt` oneof: text, token ids or chat messages; None when unset."""
    which = message.WhichOneof("prompt")
    if which == "text":
        return message.text
    if which == "token_ids":
        return tuple(message.token_ids.ids)
    if which == "chat":
        return Chat(tuple((m.role, m.content) for m in message.chat.messages))
    return None


def chunk_to_proto(chunk: ApiChunk) -> generate_pb2.GenerateChunk:
    message = generate_pb2.GenerateChunk(
        request_id=chunk.request_id, token_ids=chunk.tokens, text=chunk.text
    )
    if chunk.finish_reason is not None:
        message.finish_reason = finish_reason_to_proto(chunk.finish_reason)
    if chunk.usage is not None:
        message.usage.prompt_tokens = chunk.usage.prompt_tokens
        message.usage.completion_tokens = chunk.usage.completion_tokens
    if chunk.stats is not None:
        message.speculation.CopyFrom(stats_to_proto(chunk.stats))
    return message


def response_to_proto(whole: ApiChunk) -> generate_pb2.GenerateResponse:
    """The unary response for a whole stream merged into one chunk
    (`cluster.api.response.merge`)."""
    message = generate_pb2.GenerateResponse(
        request_id=whole.request_id, token_ids=whole.tokens, text=whole.text
    )
    if whole.finish_reason is not None:
        message.finish_reason = finish_reason_to_proto(whole.finish_reason)
    if whole.usage is not None:
        message.usage.prompt_tokens = whole.usage.prompt_tokens
        message.usage.completion_tokens = whole.usage.completion_tokens
    if whole.stats is not None:
        message.speculation.CopyFrom(stats_to_proto(whole.stats))
    return message


def usage_to_proto(tenant: str, usage: TenantUsage) -> generate_pb2.TenantUsage:
    return generate_pb2.TenantUsage(tenant=tenant, **vars(usage))


def audit_to_proto(audited: Audited) -> generate_pb2.AuditResponse:
    report = audited.report
    message = generate_pb2.AuditResponse(
        request_id=audited.served.request_id,
        token_ids=audited.served.tokens,
        matched=report.matched,
        total=report.total,
        rule=report.rule,
        drafter=report.drafter,
        dtype=report.dtype,
        cause=cause(report),
    )
    for name in (
        "first_divergence",
        "gap",
        "served_token",
        "reference_token",
        "served_gap",
        "worst_gap",
    ):
        value = getattr(report, name)
        if value is not None:
            setattr(message, name, value)
    return message


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
        predraft_hits=stats.predraft_hits,
        predraft_misses=stats.predraft_misses,
        suffix_drafted=stats.suffix_drafted,
        suffix_accepted=stats.suffix_accepted,
        model_drafted=stats.model_drafted,
        model_accepted=stats.model_accepted,
        draft_mode=stats.draft_mode,
        draft_mode_reason=stats.draft_mode_reason,
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
        predraft_hits=message.predraft_hits,
        predraft_misses=message.predraft_misses,
        suffix_drafted=message.suffix_drafted,
        suffix_accepted=message.suffix_accepted,
        model_drafted=message.model_drafted,
        model_accepted=message.model_accepted,
        draft_mode=message.draft_mode,
        draft_mode_reason=message.draft_mode_reason,
        drafted_by_position=list(message.drafted_by_position),
        accepted_by_position=list(message.accepted_by_position),
    )
