"""The two candidate encodings of a stream frame's body, for the frame codec bench.

- `ProtobufFrames`: `protos/replica.proto`'s `RouterFrame` / `ReplicaFrame`, filled and read
  field by field, q rows as `bytes` fields laid out as `cluster/wire/distributions.py` lays
  them out.
- `MsgpackFrames`: msgspec Structs mirroring the same messages field for field
  (`array_like=True`: a Struct is a msgpack array, no field names on the wire; `gc=False`: the
  collector never scans them), a oneof as a tagged union (the tag is the array's first item), q
  rows as msgpack `bin`.

Both convert the same plain values (`VerifyEntry` to a router frame, `Result` to a replica
frame; the runtime's `DraftBlock`, `Verdict` and `SparseDistribution` inside) and share the q
row <-> bytes conversion (`row_to_bytes`, `row_from_bytes`, as `wire.sparse_to_wire` and
`wire.sparse_from_wire` do it), so the bench compares the framing and nothing else. Each also
relays a drafter's frame as a verifier's frame without turning its q rows into tensors (`relay`).

Only what the hot path carries is mirrored: verify entries, and draft-block and verdict results.
Opens and closes (once a session) and errors are not measured. Nothing here checks token ids
against int32 or lengths against uint64: protobuf refuses such values when a field is set,
msgpack would need `msgspec.Meta` bounds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from cluster.runtime.draft_block import DraftBlock, StepLoad, Verdict
from cluster.runtime.sparse_distribution import SparseDistribution
from protos import replica_pb2

FRAME_VERSION = 1
MAX_INT32 = 2**31 - 1
_INT32_LE = np.dtype("<i4")
_FLOAT32_LE = np.dtype("<f4")


@dataclass(frozen=True)
class VerifyEntry:
    """One verify in a router's frame: `tag` is router-chosen and echoed by its result."""

    tag: int
    session_id: str
    block: DraftBlock
    defer_bonus: bool = False


@dataclass(frozen=True)
class Result:
    """One result in a replica's frame: a drafter's block or a verifier's verdict."""

    tag: int
    value: DraftBlock | Verdict


def row_to_bytes(row: SparseDistribution) -> tuple[bytes, bytes]:
    """(int32 ids, float32 probs), little-endian, as `wire.sparse_to_wire` lays them out."""
    ids = row.token_ids.detach().cpu()
    if ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) <= MAX_INT32):
        raise ValueError("a q row holds an id that is not an int32 token id")
    return (
        ids.numpy().astype(_INT32_LE).tobytes(),
        row.probs.detach().cpu().to(torch.float32).numpy().astype(_FLOAT32_LE).tobytes(),
    )


def row_from_bytes(ids: bytes, probs: bytes) -> SparseDistribution:
    """The row `row_to_bytes` wrote, as `wire.sparse_from_wire` reads it: native, writable
    copies (int64 ids, float32 probs)."""
    if len(ids) % 4 or len(probs) % 4 or len(ids) != len(probs):
        raise ValueError(f"a q row of {len(ids)} id bytes and {len(probs)} prob bytes")
    return SparseDistribution(
        token_ids=torch.from_numpy(np.frombuffer(ids, dtype=_INT32_LE).astype(np.int64)),
        probs=torch.from_numpy(np.frombuffer(probs, dtype=_FLOAT32_LE).astype(np.float32)),
    )


def _rows(pairs: Sequence[tuple[bytes, bytes]]) -> tuple[SparseDistribution, ...] | None:
    """The block's q rows; none on the wire reads as None (a deterministic draft)."""
    return tuple(row_from_bytes(ids, probs) for ids, probs in pairs) if pairs else None


class ProtobufFrames:
    """Frames as `replica_pb2.RouterFrame` / `ReplicaFrame`."""

    name = "protobuf"

    def encode_router(self, entries: Sequence[VerifyEntry]) -> bytes:
        frame = replica_pb2.RouterFrame(version=FRAME_VERSION)
        for entry in entries:
            verify = frame.entries.add(tag=entry.tag).verify
            verify.session_id = entry.session_id
            verify.defer_bonus = entry.defer_bonus
            _block_into(verify.block, entry.block)
        return frame.SerializeToString()

    def decode_router(self, data: bytes) -> list[VerifyEntry]:
        frame = replica_pb2.RouterFrame.FromString(data)
        out = []
        for entry in frame.entries:
            if entry.WhichOneof("call") != "verify":
                raise ValueError(f"entry {entry.tag} is not a verify")
            verify = entry.verify
            out.append(
                VerifyEntry(
                    entry.tag, verify.session_id, _block_from(verify.block), verify.defer_bonus
                )
            )
        return out

    def encode_replica(self, results: Sequence[Result]) -> bytes:
        frame = replica_pb2.ReplicaFrame(version=FRAME_VERSION)
        for result in results:
            message = frame.results.add(tag=result.tag)
            if isinstance(result.value, DraftBlock):
                _block_into(message.block, result.value)
            else:
                _verdict_into(message.verdict, result.value)
        return frame.SerializeToString()

    def decode_replica(self, data: bytes) -> list[Result]:
        frame = replica_pb2.ReplicaFrame.FromString(data)
        out = []
        for result in frame.results:
            kind = result.WhichOneof("result")
            if kind == "block":
                out.append(Result(result.tag, _block_from(result.block)))
            elif kind == "verdict":
                out.append(Result(result.tag, _verdict_from(result.verdict)))
            else:
                raise ValueError(f"result {result.tag} is a {kind}")
        return out

    def relay(self, data: bytes, session_ids: Mapping[int, str]) -> bytes:
        """A drafter's frame of blocks as a verifier's frame of verifies: the router reads each
        block's length and tokens, and copies its q row messages without reading them."""
        blocks = replica_pb2.ReplicaFrame.FromString(data)
        frame = replica_pb2.RouterFrame(version=FRAME_VERSION)
        for result in blocks.results:
            block = result.block
            base_length, tokens = block.base_length, tuple(block.token_ids)
            verify = frame.entries.add(tag=result.tag).verify
            verify.session_id = session_ids[result.tag]
            verify.block.base_length = base_length
            verify.block.token_ids.extend(tokens)
            verify.block.draft_probs.extend(block.draft_probs)
        return frame.SerializeToString()


def _block_into(message: replica_pb2.DraftBlock, block: DraftBlock) -> None:
    message.base_length = block.base_length
    message.token_ids.extend(block.tokens)
    for row in block.draft_probs or ():
        ids, probs = row_to_bytes(row)
        message.draft_probs.add(token_ids=ids, probs=probs)
    if block.load is not None:
        _load_into(message.load, block.load)


def _block_from(message: replica_pb2.DraftBlock) -> DraftBlock:
    return DraftBlock(
        base_length=message.base_length,
        tokens=tuple(message.token_ids),
        draft_probs=_rows([(row.token_ids, row.probs) for row in message.draft_probs]),
        load=_load_from(message.load) if message.HasField("load") else None,
    )


def _verdict_into(message: replica_pb2.Verdict, verdict: Verdict) -> None:
    message.base_length = verdict.base_length
    message.num_accepted = verdict.num_accepted
    message.token_ids.extend(verdict.tokens)
    message.committed_length = verdict.committed_length
    message.bonus_deferred = verdict.bonus_deferred
    if verdict.load is not None:
        _load_into(message.load, verdict.load)


def _verdict_from(message: replica_pb2.Verdict) -> Verdict:
    return Verdict(
        base_length=message.base_length,
        num_accepted=message.num_accepted,
        tokens=tuple(message.token_ids),
        committed_length=message.committed_length,
        bonus_deferred=message.bonus_deferred,
        load=_load_from(message.load) if message.HasField("load") else None,
    )


def _load_into(message: replica_pb2.StepLoad, load: StepLoad) -> None:
    message.batch_sequences = load.batch_sequences
    message.batch_tokens = load.batch_tokens
    message.cost_base_s = load.cost_base_s
    message.cost_per_token_s = load.cost_per_token_s


def _load_from(message: replica_pb2.StepLoad) -> StepLoad:
    return StepLoad(
        message.batch_sequences, message.batch_tokens, message.cost_base_s, message.cost_per_token_s
    )


class MsgRow(msgspec.Struct, array_like=True, gc=False):
    """`SparseDistribution`: int32 ids and float32 probs, little-endian."""

    token_ids: bytes
    probs: bytes


class MsgLoad(msgspec.Struct, array_like=True, gc=False):
    """`StepLoad`."""

    batch_sequences: int
    batch_tokens: int
    cost_base_s: float
    cost_per_token_s: float


class MsgBlock(msgspec.Struct, array_like=True, gc=False):
    """`DraftBlock`."""

    base_length: int
    token_ids: list[int]
    draft_probs: list[MsgRow]
    load: MsgLoad | None = None


class MsgVerdict(msgspec.Struct, array_like=True, gc=False):
    """`Verdict`."""

    base_length: int
    num_accepted: int
    token_ids: list[int]
    committed_length: int
    bonus_deferred: bool
    load: MsgLoad | None = None


class MsgVerify(msgspec.Struct, array_like=True, gc=False, tag=4):
    """`FrameEntry.verify` (the tag is the oneof field's number)."""

    tag: int
    session_id: str
    block: MsgBlock
    defer_bonus: bool = False


class MsgClose(msgspec.Struct, array_like=True, gc=False, tag=5):
    """`FrameEntry.close`."""

    tag: int
    session_id: str


class MsgRouterFrame(msgspec.Struct, array_like=True, gc=False):
    """`RouterFrame`."""

    version: int
    entries: list[MsgVerify | MsgClose]


class MsgBlockResult(msgspec.Struct, array_like=True, gc=False, tag=3):
    """`FrameResult.block`."""

    tag: int
    block: MsgBlock


class MsgVerdictResult(msgspec.Struct, array_like=True, gc=False, tag=4):
    """`FrameResult.verdict`."""

    tag: int
    verdict: MsgVerdict


class MsgError(msgspec.Struct, array_like=True, gc=False, tag=6):
    """`FrameResult.error`."""

    tag: int
    status: str
    message: str
    retry_after_ms: int | None = None


class MsgReplicaFrame(msgspec.Struct, array_like=True, gc=False):
    """`ReplicaFrame`."""

    version: int
    results: list[MsgBlockResult | MsgVerdictResult | MsgError]


class MsgpackFrames:
    """Frames as msgpack, through the Structs above."""

    name = "msgpack"

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._router = msgspec.msgpack.Decoder(MsgRouterFrame)
        self._replica = msgspec.msgpack.Decoder(MsgReplicaFrame)

    def encode_router(self, entries: Sequence[VerifyEntry]) -> bytes:
        return self._encoder.encode(
            MsgRouterFrame(
                FRAME_VERSION,
                [
                    MsgVerify(
                        entry.tag, entry.session_id, _msg_block(entry.block), entry.defer_bonus
                    )
                    for entry in entries
                ],
            )
        )

    def decode_router(self, data: bytes) -> list[VerifyEntry]:
        out = []
        for entry in self._router.decode(data).entries:
            if not isinstance(entry, MsgVerify):
                raise ValueError(f"entry {entry.tag} is not a verify")
            out.append(
                VerifyEntry(
                    entry.tag, entry.session_id, _plain_block(entry.block), entry.defer_bonus
                )
            )
        return out

    def encode_replica(self, results: Sequence[Result]) -> bytes:
        items: list[MsgBlockResult | MsgVerdictResult | MsgError] = [
            MsgBlockResult(result.tag, _msg_block(result.value))
            if isinstance(result.value, DraftBlock)
            else MsgVerdictResult(result.tag, _msg_verdict(result.value))
            for result in results
        ]
        return self._encoder.encode(MsgReplicaFrame(FRAME_VERSION, items))

    def decode_replica(self, data: bytes) -> list[Result]:
        out = []
        for result in self._replica.decode(data).results:
            if isinstance(result, MsgBlockResult):
                out.append(Result(result.tag, _plain_block(result.block)))
            elif isinstance(result, MsgVerdictResult):
                out.append(Result(result.tag, _plain_verdict(result.verdict)))
            else:
                raise ValueError(f"result {result.tag} is an error: {result.status}")
        return out

    def relay(self, data: bytes, session_ids: Mapping[int, str]) -> bytes:
        """As `ProtobufFrames.relay`: the q rows' decoded `MsgRow`s go out as they came in."""
        entries: list[MsgVerify | MsgClose] = []
        for result in self._replica.decode(data).results:
            if not isinstance(result, MsgBlockResult):
                raise ValueError(f"result {result.tag} is not a block")
            block = result.block
            entries.append(
                MsgVerify(
                    result.tag,
                    session_ids[result.tag],
                    MsgBlock(block.base_length, block.token_ids, block.draft_probs),
                )
            )
        return self._encoder.encode(MsgRouterFrame(FRAME_VERSION, entries))


def _msg_load(load: StepLoad | None) -> MsgLoad | None:
    if load is None:
        return None
    return MsgLoad(load.batch_sequences, load.batch_tokens, load.cost_base_s, load.cost_per_token_s)


def _plain_load(load: MsgLoad | None) -> StepLoad | None:
    if load is None:
        return None
    return StepLoad(
        load.batch_sequences, load.batch_tokens, load.cost_base_s, load.cost_per_token_s
    )


def _msg_block(block: DraftBlock) -> MsgBlock:
    rows = [MsgRow(*row_to_bytes(row)) for row in block.draft_probs or ()]
    return MsgBlock(block.base_length, list(block.tokens), rows, _msg_load(block.load))


def _plain_block(block: MsgBlock) -> DraftBlock:
    return DraftBlock(
        base_length=block.base_length,
        tokens=tuple(block.token_ids),
        draft_probs=_rows([(row.token_ids, row.probs) for row in block.draft_probs]),
        load=_plain_load(block.load),
    )


def _msg_verdict(verdict: Verdict) -> MsgVerdict:
    return MsgVerdict(
        verdict.base_length,
        verdict.num_accepted,
        list(verdict.tokens),
        verdict.committed_length,
        verdict.bonus_deferred,
        _msg_load(verdict.load),
    )


def _plain_verdict(verdict: MsgVerdict) -> Verdict:
    return Verdict(
        base_length=verdict.base_length,
        num_accepted=verdict.num_accepted,
        tokens=tuple(verdict.token_ids),
        committed_length=verdict.committed_length,
        bonus_deferred=verdict.bonus_deferred,
        load=_plain_load(verdict.load),
    )


CODECS = (ProtobufFrames, MsgpackFrames)
"""Both candidates, in the order the bench interleaves them."""
