"""What one Frames stream may hold, and how it refuses more (`StreamLimits`).

The replica's server counts a stream as one call however much its frames bring, so the stream
bounds that itself; each bound is a module constant that says why its value:

- entries in one frame, `MAX_FRAME_ENTRIES`: a frame with more is the stream's error
  (`check_frame`: `InvalidArgumentError`, INVALID_ARGUMENT, naming the limit), refused before
  any of its entries is read, like a frame of another layout version: refusing each entry
  instead would still cost a result per entry, millions of them for one 64 MiB frame of empty
  entries.
- entries pending (submitted and not answered yet), `MAX_PENDING_ENTRIES`: an entry read
  beyond it is refused alone (`pending_limit_error`: RESOURCE_EXHAUSTED naming the limit), and
  the stream reads on. Refusing rather than not reading further frames (backpressure) because
  the frames the stream would stop reading also carry the cancels and closes that drain the
  work; because a router held back batches what it holds into larger frames, towards
  `MAX_FRAME_ENTRIES`; and because errors are per entry everywhere else on the stream.
- results its router has not read yet, `MAX_UNSENT_RESULTS` (`cluster.replica.outgoing_frames`,
  the queue between the stream and the transport): a router that leaves more unread ends its
  stream (`unread_limit_error`). Not bounded by the pending limit: a running session's own
  steps report on without any entry pending; and the producer cannot wait for the router.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.runtime.errors import InvalidArgumentError, ResourceExhaustedError
from cluster.runtime.limits import DEFAULT_MAX_SESSIONS
from cluster.wire.requests import FRAME_VERSION
from protos import replica_pb2

MAX_PENDING_ENTRIES = 32 * DEFAULT_MAX_SESSIONS
"""Entries one stream may have submitted and not yet answered (8192); one more is refused with
RESOURCE_EXHAUSTED. A router has at most 4 entries pending per session on a replica (an open or
a close, a draft call or up to two posted blocks: docs/architecture.md, "Ordering"), for at
most the sessions it runs (`max_running_requests`, 64 by default) and never usefully more than
a replica holds (`max_sessions`, `DEFAULT_MAX_SESSIONS` = 256 by default): 256 sessions' 1024
entries are an eighth of it; it takes 2048 sessions on one stream to reach it. At the limit a
stream holds 8192 futures and tasks: some megabytes, not the replica's memory."""

MAX_FRAME_ENTRIES = MAX_PENDING_ENTRIES
"""Entries one `RouterFrame` may carry (8192); a frame with more ends its stream with
INVALID_ARGUMENT. A router's frame is whatever it has pending for the replica when gRPC takes
the next one: at most the pending entries above plus the cancels of entries it gave up (one per
entry at most), 8 a session, so 2048 for 256 sessions, a quarter of the limit. A frame that
alone would fill the pending limit is no router's; and the limit caps what one frame of empty
entries (4 bytes each: 16 million within the 64 MiB message limit) can make the stream do."""

MAX_UNSENT_RESULTS = 8 * MAX_FRAME_ENTRIES
"""Results a stream may have made that its router has not read (65536); one more ends the
stream (`OutgoingFrames`). A router's receiver reads each frame as it comes, so results wait
only while the transport is behind or the router stalls: at 256 running sessions and 100
steps a second (a GPU's small-batch decode) this is 2.5 s of steps unread, 10 s at 64 sessions;
and it is 8 times what one frame's entries can be answered with. About 200 bytes a result
(one-token verdicts), some 13 MB at the limit."""


@dataclass(frozen=True)
class StreamLimits:
    """What one Frames stream may hold (see the module docstring); the defaults are the module's
    constants, which tests narrow."""

    frame_entries: int = MAX_FRAME_ENTRIES
    pending_entries: int = MAX_PENDING_ENTRIES
    unsent_results: int = MAX_UNSENT_RESULTS


def check_frame(frame: replica_pb2.RouterFrame, limits: StreamLimits) -> None:
    """Raise `InvalidArgumentError` for a frame its stream must end on: one of another layout
    version, or with more than `limits.frame_entries` entries (naming the limit)."""
    if frame.version != FRAME_VERSION:
        raise InvalidArgumentError(
            f"frame version {frame.version} is not supported (this replica speaks "
            f"version {FRAME_VERSION})"
        )
    if len(frame.entries) > limits.frame_entries:
        raise InvalidArgumentError(
            f"a frame carries at most {limits.frame_entries} entries (MAX_FRAME_ENTRIES), "
            f"got {len(frame.entries)}"
        )


def pending_limit_error(limits: StreamLimits) -> ResourceExhaustedError:
    """An entry's refusal when its stream already has `limits.pending_entries` pending."""
    return ResourceExhaustedError(
        f"this stream already has {limits.pending_entries} entries pending, the most it may "
        "have (MAX_PENDING_ENTRIES); send more once they are answered"
    )


def unread_limit_error(limit: int) -> ResourceExhaustedError:
    """What ends a stream whose router left more than `limit` results unread."""
    return ResourceExhaustedError(
        f"the router left more than {limit} results unread (MAX_UNSENT_RESULTS): the stream "
        "is ended"
    )
