"""How a session samples and what constrains it, on the wire: `SamplingParams`, `Grammar` and
`Constraint` <-> `protos/sampling.proto` and `OpenSessionRequest`'s constraint fields.

Contract: what comes off the wire is checked only as far as the wire format can tell, and by
the checks the plain types make when built (`SamplingParams` rejects a NaN temperature or
`top_p = 0`); an unknown sampling rule is refused. Each refusal is an `InvalidArgumentError`.

Exactness: `SamplingParams.temperature` and `top_p` travel as float32, so a value that float32
cannot hold (0.7) comes back rounded to the nearest one; the sampling code computes in float32,
so the distribution is the same.
"""

from __future__ import annotations

from cluster.runtime.constraint import JSON_OBJECT, Constraint, Grammar
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.sampling_params import NO_TOP_P, SamplingParams
from cluster.wire.fields import MAX_UINT32, token_ids_to_wire, uint_to_wire
from protos import replica_pb2, sampling_pb2


def sampling_to_wire(params: SamplingParams) -> sampling_pb2.SamplingParams:
    message = sampling_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        rule=(
            sampling_pb2.SAMPLING_RULE_SEED_EXACT
            if params.seed_exact
            else sampling_pb2.SAMPLING_RULE_REJECTION
        ),
    )
    if params.top_p != NO_TOP_P:
        message.top_p = params.top_p
    return message


def sampling_from_wire(message: sampling_pb2.SamplingParams) -> SamplingParams:
    """Unset `top_p` means no nucleus cut (1.0); a set one, even 0.0, is taken as sent. An
    unspecified rule reads as rejection sampling: the public API resolves a request's rule
    (`cluster.api.sampling_rule.resolve_seed_exact`) before anything reaches a replica."""
    top_p = message.top_p if message.HasField("top_p") else NO_TOP_P
    if message.rule not in _RULES:
        raise InvalidArgumentError(f"sampling.rule {message.rule} is not a SamplingRule")
    return SamplingParams(
        temperature=message.temperature,
        top_k=message.top_k,
        top_p=top_p,
        seed_exact=message.rule == sampling_pb2.SAMPLING_RULE_SEED_EXACT,
    )


_RULES = frozenset(sampling_pb2.SamplingRule.values())


def grammar_to_wire(grammar: Grammar | None) -> sampling_pb2.Grammar:
    """Unset for None (no grammar)."""
    message = sampling_pb2.Grammar()
    if grammar is None:
        return message
    if grammar.kind == JSON_OBJECT:
        message.json_object = True
    else:
        setattr(message, grammar.kind, grammar.source)
    return message


def grammar_from_wire(message: sampling_pb2.Grammar) -> Grammar | None:
    """None when no kind is set (or `json_object` is false)."""
    kind = message.WhichOneof("kind")
    if kind is None or (kind == JSON_OBJECT and not message.json_object):
        return None
    return Grammar(kind, "" if kind == JSON_OBJECT else getattr(message, kind))


def constraint_to_wire(
    constraint: Constraint | None, request: replica_pb2.OpenSessionRequest
) -> None:
    """Set `request`'s constraint fields (none for None)."""
    if constraint is None:
        return
    request.grammar.CopyFrom(grammar_to_wire(constraint.grammar))
    request.min_tokens = uint_to_wire(constraint.min_tokens, "min_tokens", MAX_UINT32)
    request.end_token_ids.extend(
        token_ids_to_wire(sorted(constraint.end_token_ids), "end_token_ids")
    )
    request.prompt_length = uint_to_wire(constraint.prompt_length, "prompt_length", MAX_UINT32)


def constraint_from_wire(request: replica_pb2.OpenSessionRequest) -> Constraint | None:
    """None when the request constrains nothing."""
    constraint = Constraint(
        grammar=grammar_from_wire(request.grammar),
        min_tokens=request.min_tokens,
        end_token_ids=frozenset(request.end_token_ids),
        prompt_length=(
            request.prompt_length
            if request.HasField("prompt_length")
            else len(request.prompt_token_ids)
        ),
    )
    return constraint if constraint.active else None
