"""The replica API's requests: built by the router's clients, read back by the replica's
servicers and Frames streams, so that both ends share one layout.

`open_request_to_wire`, `draft_request_to_wire`, `predraft_request_to_wire`,
`verify_request_to_wire` and `close_request_to_wire` build the messages; `*_from_wire` reads
each back as the arguments of the component's call (`OpenCall`, `DraftCall`, `PredraftCall`,
`VerifyCall`). Values inside them are laid out by `cluster.wire.fields`, `sampling_settings`,
`distributions` and `blocks`, which check what comes off the wire as far as the wire can
tell. `FRAME_VERSION` is the layout of the frames that carry them (`protos/replica.proto`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cluster.runtime.advance import Advance
from cluster.runtime.constraint import Constraint
from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.predraft import Branch
from cluster.runtime.sampling_params import SamplingParams
from cluster.wire.blocks import block_from_wire, block_to_wire, branch_from_wire, branch_to_wire
from cluster.wire.fields import (
    MAX_UINT32,
    session_id_from_wire,
    time_limit_from_wire,
    time_limit_to_wire,
    token_ids_to_wire,
    uint_to_wire,
)
from cluster.wire.sampling_settings import (
    constraint_from_wire,
    constraint_to_wire,
    sampling_from_wire,
    sampling_to_wire,
)
from protos import replica_pb2

FRAME_VERSION = 1
"""`RouterFrame.version` and `ReplicaFrame.version` of the frame layout in `protos/replica.proto`;
a replica ends a stream whose frames carry another (INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class OpenCall:
    """An OpenSession request read off the wire: the arguments of the component's
    `open_session` / `submit_open`."""

    session_id: str
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams
    seed: int
    time_limit_s: float | None
    """Seconds the request has left (None: no deadline)."""
    max_new_tokens: int | None
    resumed: bool
    constraint: Constraint | None
    tenant: str = ""
    """Whose request it is (a suffix drafter's scope); "" when unset."""
    advance: Advance | None = None
    """A verifier's running session: where its output ends (None: not running)."""


@dataclass(frozen=True)
class DraftCall:
    """A Draft request read off the wire: the arguments of `Drafter.draft` / `submit_draft`."""

    session_id: str
    base_length: int
    appended_tokens: tuple[int, ...]
    num_tokens: int
    truncate_to: int | None


@dataclass(frozen=True)
class PredraftCall:
    """A Predraft request read off the wire: the arguments of `Drafter.predraft` /
    `submit_predraft`."""

    session_id: str
    base_length: int
    appended_tokens: tuple[int, ...]
    block: tuple[int, ...]
    branches: tuple[Branch, ...]
    num_tokens: int
    truncate_to: int | None


@dataclass(frozen=True)
class VerifyCall:
    """A Verify request read off the wire: the arguments of `Verifier.verify` /
    `submit_verify` (the block's q decoded)."""

    session_id: str
    block: DraftBlock
    defer_bonus: bool


def open_request_to_wire(
    session_id: str,
    prompt_tokens: Sequence[int],
    sampling: SamplingParams,
    seed: int,
    *,
    max_new_tokens: int | None = None,
    resumed: bool = False,
    constraint: Constraint | None = None,
    time_left_s: float | None = None,
    tenant: str = "",
    advance: Advance | None = None,
) -> replica_pb2.OpenSessionRequest:
    """`time_left_s`: the request's time left, sent as `time_limit_ms` (None: unset);
    `tenant`: whose request it is (read by a suffix drafter only); `advance`: a verifier
    session that runs (None: unset)."""
    request = replica_pb2.OpenSessionRequest(
        session_id=session_id,
        prompt_token_ids=token_ids_to_wire(prompt_tokens, "prompt_tokens"),
        sampling=sampling_to_wire(sampling),
        seed=uint_to_wire(seed, "seed"),
        resumed=resumed,
        tenant=tenant,
    )
    constraint_to_wire(constraint, request)
    if max_new_tokens is not None:
        request.max_new_tokens = uint_to_wire(max_new_tokens, "max_new_tokens", MAX_UINT32)
    if time_left_s is not None:
        request.time_limit_ms = time_limit_to_wire(time_left_s)
    if advance is not None:
        request.advance.max_length = uint_to_wire(advance.max_length, "advance.max_length")
        request.advance.end_token_ids.extend(
            token_ids_to_wire(sorted(advance.end_token_ids), "advance.end_token_ids")
        )
        request.advance.ends_from = uint_to_wire(advance.ends_from, "advance.ends_from")
    return request


def open_request_from_wire(request: replica_pb2.OpenSessionRequest) -> OpenCall:
    return OpenCall(
        session_id=session_id_from_wire(request.session_id),
        prompt_tokens=tuple(request.prompt_token_ids),
        sampling=sampling_from_wire(request.sampling),
        seed=request.seed,
        time_limit_s=time_limit_from_wire(request),
        max_new_tokens=request.max_new_tokens if request.HasField("max_new_tokens") else None,
        resumed=request.resumed,
        constraint=constraint_from_wire(request),
        tenant=request.tenant,
        advance=advance_from_wire(request),
    )


def advance_from_wire(request: replica_pb2.OpenSessionRequest) -> Advance | None:
    """The open's `advance`, None when unset; INVALID_ARGUMENT for one that cannot be."""
    if not request.HasField("advance"):
        return None
    message = request.advance
    return Advance(
        max_length=message.max_length,
        end_token_ids=frozenset(message.end_token_ids),
        ends_from=message.ends_from,
    )


def draft_request_to_wire(
    session_id: str,
    base_length: int,
    appended_tokens: Sequence[int],
    num_tokens: int,
    truncate_to: int | None = None,
) -> replica_pb2.DraftRequest:
    request = replica_pb2.DraftRequest(
        session_id=session_id,
        base_length=uint_to_wire(base_length, "base_length"),
        appended_token_ids=token_ids_to_wire(appended_tokens, "appended_tokens"),
        num_tokens=uint_to_wire(num_tokens, "num_tokens", MAX_UINT32),
    )
    if truncate_to is not None:
        request.truncate_to = uint_to_wire(truncate_to, "truncate_to")
    return request


def draft_request_from_wire(request: replica_pb2.DraftRequest) -> DraftCall:
    return DraftCall(
        session_id=session_id_from_wire(request.session_id),
        base_length=request.base_length,
        appended_tokens=tuple(request.appended_token_ids),
        num_tokens=request.num_tokens,
        truncate_to=request.truncate_to if request.HasField("truncate_to") else None,
    )


def predraft_request_to_wire(
    session_id: str,
    base_length: int,
    appended_tokens: Sequence[int],
    block: Sequence[int],
    branches: Sequence[Branch],
    num_tokens: int,
    truncate_to: int | None = None,
) -> replica_pb2.PredraftRequest:
    """`block`: the tokens being verified; `branches`: the outcomes of that to draft after."""
    request = replica_pb2.PredraftRequest(
        session_id=session_id,
        base_length=uint_to_wire(base_length, "base_length"),
        appended_token_ids=token_ids_to_wire(appended_tokens, "appended_tokens"),
        block_token_ids=token_ids_to_wire(block, "block"),
        branches=[branch_to_wire(branch) for branch in branches],
        num_tokens=uint_to_wire(num_tokens, "num_tokens", MAX_UINT32),
    )
    if truncate_to is not None:
        request.truncate_to = uint_to_wire(truncate_to, "truncate_to")
    return request


def predraft_request_from_wire(request: replica_pb2.PredraftRequest) -> PredraftCall:
    return PredraftCall(
        session_id=session_id_from_wire(request.session_id),
        base_length=request.base_length,
        appended_tokens=tuple(request.appended_token_ids),
        block=tuple(request.block_token_ids),
        branches=tuple(branch_from_wire(branch) for branch in request.branches),
        num_tokens=request.num_tokens,
        truncate_to=request.truncate_to if request.HasField("truncate_to") else None,
    )


def verify_request_to_wire(
    session_id: str, block: DraftBlock, defer_bonus: bool = False
) -> replica_pb2.VerifyRequest:
    """The block's `WireRows` (a drafter's q, as received) are copied as bytes."""
    return replica_pb2.VerifyRequest(
        session_id=session_id, block=block_to_wire(block), defer_bonus=defer_bonus
    )


def verify_request_from_wire(request: replica_pb2.VerifyRequest) -> VerifyCall:
    return VerifyCall(
        session_id=session_id_from_wire(request.session_id),
        block=block_from_wire(request.block),
        defer_bonus=request.defer_bonus,
    )


def close_request_to_wire(session_id: str) -> replica_pb2.CloseSessionRequest:
    return replica_pb2.CloseSessionRequest(session_id=session_id)


def close_request_from_wire(request: replica_pb2.CloseSessionRequest) -> str:
    """The session id to close."""
    return session_id_from_wire(request.session_id)
