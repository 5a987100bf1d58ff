"""How many entries go in one frame: a byte budget well under gRPC's message limit.

A frame carries whatever is pending, so under load it could carry many sessions' draft blocks
with dense q rows (a full-vocabulary row is 600 KiB-1.2 MiB): 64 such sessions would pass
`MAX_MESSAGE_BYTES` (64 MiB), and gRPC would fail the whole stream, and every session on it,
for one frame too many. `split_by_size` cuts a run of messages into consecutive groups of at
most `MAX_FRAME_BYTES` serialized bytes each (a message larger than that alone goes in a group
of its own: it is within the message limit, as a unary call's would be). Order is kept. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from cluster.wire.metadata import MAX_MESSAGE_BYTES

MAX_FRAME_BYTES = MAX_MESSAGE_BYTES // 4
"""The bytes of entries or results one frame gathers (16 MiB): several frames where more is
pending, each far below the 64 MiB message limit."""


class Sized(Protocol):
    def ByteSize(self) -> int: ...


M = TypeVar("M", bound=Sized)


def split_by_size(messages: Sequence[M], budget: int = MAX_FRAME_BYTES) -> list[list[M]]:
    """`messages` in order, cut into groups of at most `budget` serialized bytes (a larger
    message alone); no empty group."""
    groups: list[list[M]] = []
    group: list[M] = []
    size = 0
    for message in messages:
        bytes_ = message.ByteSize()
        if group and size + bytes_ > budget:
            groups.append(group)
            group, size = [], 0
        group.append(message)
        size += bytes_
    if group:
        groups.append(group)
    return groups
