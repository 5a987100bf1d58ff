"""Drafted q rows on the wire: `SparseDistribution` <-> `replica.proto`'s `SparseDistribution`,
a drafted block's rows as its repeated field, and raw float32 arrays.

Contract: a row coming off the wire is checked only for its byte arrays being whole values
and its ids and probabilities agreeing in count (`check_sparse`), and a block's rows for
being one per drafted token or none; its contents (empty, repeated ids, negative or NaN
probabilities, ids outside the vocabulary) are `sparse_distribution.to_dense`'s to refuse, on the
replica. Each refusal is an `InvalidArgumentError` naming the row.

Exactness: ids travel as int32 bytes and probabilities as float32 bytes, both little-endian,
and `SparseDistribution.probs` is float32, so q round-trips bit for bit
(docs/architecture.md, invariant 1).

Pass-through: with `lazy_rows` (the router) a block's rows stay the protobuf messages that
came off the wire (`WireRows`, decoded only if indexed; a slice of them is still undecoded),
and `draft_probs_to_wire` copies those messages on as they are: the router never decodes or
re-encodes q.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np
import torch

from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.sparse_distribution import SparseDistribution
from cluster.wire.fields import MAX_INT32
from protos import replica_pb2

_INT32_LE = np.dtype("<i4")
_FLOAT32_LE = np.dtype("<f4")
"""The byte layout of a sparse row's arrays on the wire, whatever the host's byte order."""


def sparse_to_wire(row: SparseDistribution) -> replica_pb2.SparseDistribution:
    """Ids as little-endian int32 bytes, probabilities as little-endian float32 bytes."""
    ids = row.token_ids.detach().cpu()
    if ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) <= MAX_INT32):
        bad = int(((ids < 0) | (ids > MAX_INT32)).nonzero()[0, 0])
        raise InvalidArgumentError(
            f"token_ids[{bad}] = {int(ids[bad])} is not a token id (0..{MAX_INT32})"
        )
    return replica_pb2.SparseDistribution(
        token_ids=ids.numpy().astype(_INT32_LE).tobytes(),
        probs=row.probs.detach().cpu().to(torch.float32).numpy().astype(_FLOAT32_LE).tobytes(),
    )


def sparse_from_wire(
    message: replica_pb2.SparseDistribution, what: str = "sparse distribution"
) -> SparseDistribution:
    """Ids and probabilities as sent; only their sizes and counts are checked (see the module
    doc)."""
    check_sparse(message, what)
    ids = np.frombuffer(message.token_ids, dtype=_INT32_LE)
    probs = np.frombuffer(message.probs, dtype=_FLOAT32_LE)
    return SparseDistribution(
        token_ids=torch.from_numpy(ids.astype(np.int64)),
        probs=torch.from_numpy(probs.astype(np.float32)),  # a native, writable copy
    )


def check_sparse(message: replica_pb2.SparseDistribution, what: str) -> None:
    """Refuse a row whose byte arrays are not whole values or whose counts differ, without
    decoding it."""
    for field in ("token_ids", "probs"):
        if len(getattr(message, field)) % 4:
            raise InvalidArgumentError(f"{what}.{field} is not a whole number of 4-byte values")
    num_ids, num_probs = len(message.token_ids) // 4, len(message.probs) // 4
    if num_ids != num_probs:
        raise InvalidArgumentError(f"{what} has {num_ids} token ids but {num_probs} probabilities")


class WireRows(Sequence[SparseDistribution]):
    """A draft block's q rows as they came off the wire: the protobuf messages, each decoded
    into a `SparseDistribution` only if indexed. The router holds a drafter's block this way
    and `block_to_wire` sends the same messages on to the verifier, never decoding q."""

    def __init__(self, messages: Sequence[replica_pb2.SparseDistribution]) -> None:
        """Checks each row's sizes (`check_sparse`); reads no value."""
        for position, message in enumerate(messages):
            check_sparse(message, f"draft_probs[{position}]")
        self.messages = messages
        """The rows as received (the caller must not change them)."""

    def __len__(self) -> int:
        return len(self.messages)

    @overload
    def __getitem__(self, index: int) -> SparseDistribution: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[SparseDistribution]: ...

    def __getitem__(self, index: int | slice) -> SparseDistribution | Sequence[SparseDistribution]:
        if isinstance(index, slice):  # still as received: a prefix goes on undecoded
            return WireRows(self.messages[index])
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"draft_probs[{index}] out of range ({len(self)} rows)")
        return sparse_from_wire(self.messages[index], f"draft_probs[{index}]")

    def __iter__(self) -> Iterator[SparseDistribution]:
        return (self[i] for i in range(len(self)))


def floats_to_wire(values: Sequence[float]) -> bytes:
    """Numbers as raw little-endian float32 bytes (a reference's gaps), laid out like a sparse
    row's probabilities."""
    return np.asarray(values, dtype=np.float32).astype(_FLOAT32_LE).tobytes()


def floats_from_wire(data: bytes, what: str) -> tuple[float, ...]:
    """The float32 values of `floats_to_wire`'s bytes; a length that is not a whole number of
    values is refused, naming `what`."""
    if len(data) % 4:
        raise InvalidArgumentError(f"{what} is not a whole number of 4-byte values")
    return tuple(float(value) for value in np.frombuffer(data, dtype=_FLOAT32_LE))


def draft_probs_to_wire(
    rows: Sequence[SparseDistribution] | None,
) -> list[replica_pb2.SparseDistribution]:
    """A drafted block's q rows (a `DraftBlock`'s or a `PreDraft`'s `draft_probs`) as the
    wire's repeated field: None and () both empty, `WireRows` as received (not decoded)."""
    if isinstance(rows, WireRows):
        return list(rows.messages)
    return [sparse_to_wire(row) for row in rows or ()]


def draft_probs_from_wire(
    rows: Sequence[replica_pb2.SparseDistribution],
    num_tokens: int,
    what: str,
    lazy_rows: bool = False,
) -> Sequence[SparseDistribution] | None:
    """The q rows of a drafted block of `num_tokens` tokens (`what` names it in an error):
    None when empty (deterministic draft), else one per token, decoded, or with `lazy_rows`
    kept as received (`WireRows`, sizes checked)."""
    if not rows:
        return None
    if len(rows) != num_tokens:
        raise InvalidArgumentError(
            f"{what} has {num_tokens} tokens but {len(rows)} draft distributions: "
            "send one per token, or none for a deterministic draft"
        )
    if lazy_rows:
        return WireRows(rows)
    return tuple(sparse_from_wire(row, f"draft_probs[{i}]") for i, row in enumerate(rows))
