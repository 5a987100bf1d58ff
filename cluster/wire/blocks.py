"""Draft blocks, pre-drafted branches, verdicts and step loads on the wire: `DraftBlock`,
`Branch`, `PreDraft`, `Verdict` and `StepLoad` <-> their `protos/replica.proto` messages.

Contract: a block's tokens must be ids the wire can hold and its counts fit their fields, or
`*_to_wire` refuses it before sending; coming off the wire, a block's or a branch's q rows
must be one per token or none (`cluster.wire.distributions`). Whether the tokens fit the
vocabulary, a base the session, or a branch's `accepted` its block is the replica's to check.
Each refusal is an `InvalidArgumentError` naming the field.

Pass-through: a draft block read on the router (`block_from_wire(..., lazy_rows=True)`) keeps
its q rows as the messages that came off the wire (`WireRows`), and `block_to_wire` copies
them into the verify request as they are; a pre-drafted branch read on the router
(`predraft_from_wire(..., lazy_rows=True)`) keeps its q the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

from cluster.runtime.draft_block import DraftBlock, StepLoad, Verdict
from cluster.runtime.predraft import Branch, PreDraft
from cluster.wire.distributions import draft_probs_from_wire, draft_probs_to_wire
from cluster.wire.fields import MAX_UINT32, token_ids_to_wire, uint_to_wire
from protos import replica_pb2


def load_to_wire(load: StepLoad) -> replica_pb2.StepLoad:
    return replica_pb2.StepLoad(
        batch_sequences=uint_to_wire(load.batch_sequences, "load.batch_sequences", MAX_UINT32),
        batch_tokens=uint_to_wire(load.batch_tokens, "load.batch_tokens", MAX_UINT32),
        cost_base_s=load.cost_base_s,
        cost_per_token_s=load.cost_per_token_s,
    )


def load_from_wire(message: replica_pb2.StepLoad) -> StepLoad:
    return StepLoad(
        batch_sequences=message.batch_sequences,
        batch_tokens=message.batch_tokens,
        cost_base_s=message.cost_base_s,
        cost_per_token_s=message.cost_per_token_s,
    )


def block_to_wire(block: DraftBlock) -> replica_pb2.DraftBlock:
    """`draft_probs` None and () both become an empty field (see `block_from_wire`), and
    `WireRows` are copied as received; a `load` of None leaves the field unset."""
    message = replica_pb2.DraftBlock(
        base_length=uint_to_wire(block.base_length, "base_length"),
        token_ids=token_ids_to_wire(block.tokens, "block.tokens"),
        draft_probs=draft_probs_to_wire(block.draft_probs),
    )
    if block.assumed:
        message.assumed_token_ids.extend(token_ids_to_wire(block.assumed, "block.assumed"))
    if block.load is not None:
        message.load.CopyFrom(load_to_wire(block.load))
    return message


def block_from_wire(message: replica_pb2.DraftBlock, *, lazy_rows: bool = False) -> DraftBlock:
    """An empty `draft_probs` reads back as None (deterministic draft, q one-hot).

    A block of zero tokens drafted by sampling had `draft_probs == ()`, which the wire cannot
    tell from None; with no token to accept, the two mean the same to the verifier.
    `lazy_rows` (the router): q stays as the received messages (`WireRows`, sizes checked),
    for `block_to_wire` to pass on; otherwise every row is decoded here.
    """
    tokens = tuple(message.token_ids)
    return DraftBlock(
        base_length=message.base_length,
        tokens=tokens,
        draft_probs=draft_probs_from_wire(message.draft_probs, len(tokens), "block", lazy_rows),
        load=load_from_wire(message.load) if message.HasField("load") else None,
        assumed=tuple(message.assumed_token_ids),
    )


def branch_to_wire(branch: Branch) -> replica_pb2.PredraftBranch:
    return replica_pb2.PredraftBranch(
        accepted=uint_to_wire(branch.accepted, "branch.accepted", MAX_UINT32),
        rank=uint_to_wire(branch.rank, "branch.rank", MAX_UINT32),
    )


def branch_from_wire(message: replica_pb2.PredraftBranch) -> Branch:
    """As sent: whether `accepted` fits the block is the drafter's check."""
    return Branch(accepted=message.accepted, rank=message.rank)


def predraft_to_wire(branch: PreDraft) -> replica_pb2.PreDraft:
    """q rows as `block_to_wire` sends a block's."""
    message = replica_pb2.PreDraft(
        accepted=uint_to_wire(branch.accepted, "predraft.accepted", MAX_UINT32),
        token=token_ids_to_wire((branch.token,), "predraft.token")[0],
        token_ids=token_ids_to_wire(branch.tokens, "predraft.tokens"),
        draft_probs=draft_probs_to_wire(branch.draft_probs),
    )
    if branch.load is not None:
        message.load.CopyFrom(load_to_wire(branch.load))
    return message


def predraft_from_wire(message: replica_pb2.PreDraft, *, lazy_rows: bool = False) -> PreDraft:
    """q rows as `block_from_wire` reads a block's (`lazy_rows`: the router's, kept as
    received)."""
    tokens = tuple(message.token_ids)
    return PreDraft(
        accepted=message.accepted,
        token=message.token,
        tokens=tokens,
        draft_probs=draft_probs_from_wire(message.draft_probs, len(tokens), "predraft", lazy_rows),
        load=load_from_wire(message.load) if message.HasField("load") else None,
    )


def predrafts_to_wire(branches: Sequence[PreDraft]) -> replica_pb2.PredraftResponse:
    return replica_pb2.PredraftResponse(branches=[predraft_to_wire(b) for b in branches])


def predrafts_from_wire(
    message: replica_pb2.PredraftResponse, *, lazy_rows: bool = False
) -> list[PreDraft]:
    return [predraft_from_wire(b, lazy_rows=lazy_rows) for b in message.branches]


def verdict_to_wire(verdict: Verdict) -> replica_pb2.Verdict:
    """A `load` of None leaves the field unset."""
    message = replica_pb2.Verdict(
        base_length=verdict.base_length,
        num_accepted=verdict.num_accepted,
        token_ids=verdict.tokens,
        committed_length=verdict.committed_length,
        bonus_deferred=verdict.bonus_deferred,
        num_matched=verdict.num_matched,
        dropped=verdict.dropped,
    )
    if verdict.load is not None:
        message.load.CopyFrom(load_to_wire(verdict.load))
    return message


def verdict_from_wire(message: replica_pb2.Verdict) -> Verdict:
    return Verdict(
        base_length=message.base_length,
        num_accepted=message.num_accepted,
        tokens=tuple(message.token_ids),
        committed_length=message.committed_length,
        bonus_deferred=message.bonus_deferred,
        load=load_from_wire(message.load) if message.HasField("load") else None,
        num_matched=message.num_matched,
        dropped=message.dropped,
    )
