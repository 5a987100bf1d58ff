"""A verifier replica's side of the audit: replay a finished request at low priority.

`ReferenceReplayer.reference` runs `verifier.reference.replay` (the plain target, teacher-forced
on the served tokens, no drafter, no batching, no session) in the *calling* thread (a gRPC
handler's, or an in-process caller's), never on the engine's thread, so that no step of user
traffic ever waits for an audit. Before each chunk of the replay it waits (`wait_until_idle`)
until the replica's engine has had no call queued or running for `quiet_s`, polling every
`poll_s`: audit work yields to user traffic between chunks. A chunk already running is not
interrupted; a call that arrives during one waits at most that chunk's forward pass.

Weights: `dtype` "" replays with the replica's own target; "float32" with a float32 copy of it
(`verifier.reference.fp32_copy`: the target itself when it already is float32), made on first
use, once, and kept for the replica's life.

If the caller goes away (the RPC is cancelled or times out: `cluster.runtime.call_scope`) while
the replay waits, it stops with `CancelledError`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from cluster.runtime.call_scope import Gone, caller_gone
from cluster.runtime.errors import CancelledError, InvalidArgumentError
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.session import check_seed
from verifier.config import FLOAT32, OWN_DTYPE, check_reference_dtype
from verifier.reference import DEFAULT_CHUNK_TOKENS, Replay, fp32_copy, replay

POLL_S = 0.002
"""How often a waiting replay looks at the engine again."""
QUIET_S = 0.004
"""How long the engine must have been idle before a chunk runs: a gap between a request's
rounds (a few milliseconds) does not let a chunk in as readily as a real lull does."""


def wait_until_idle(
    has_work: Callable[[], bool],
    *,
    poll_s: float = POLL_S,
    quiet_s: float = QUIET_S,
    gone: Gone | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Return once `has_work()` has answered False for `quiet_s` straight (at once when
    `quiet_s` is 0 and it answers False), asking every `poll_s`; returns the seconds waited.
    Raises `CancelledError` once `gone` is set."""
    started = clock()
    idle_since: float | None = None
    while True:
        if gone is not None and gone.is_set():
            raise CancelledError("the caller gave up the audit while it waited for the replica")
        now = clock()
        if has_work():
            idle_since = None
        else:
            idle_since = now if idle_since is None else idle_since
            if now - idle_since >= quiet_s:
                return now - started
        sleep(poll_s)


class ReferenceReplayer:
    """Replays requests through one replica's target, yielding to its engine's calls."""

    def __init__(
        self,
        target: LoadedModel,
        has_work: Callable[[], bool],
        *,
        max_context_tokens: int | None = None,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        poll_s: float = POLL_S,
        quiet_s: float = QUIET_S,
    ) -> None:
        """`has_work`: whether the replica's engine has calls queued or running
        (`Engine.has_work`). `max_context_tokens`: the longest prompt plus served tokens
        replayed (None: no limit)."""
        self._target = target
        self._has_work = has_work
        self._max_context_tokens = max_context_tokens
        self._chunk_tokens = chunk_tokens
        self._poll_s = poll_s
        self._quiet_s = quiet_s
        self._fp32: LoadedModel | None = None
        self._fp32_lock = threading.Lock()
        self._lock = threading.Lock()
        self.chunks = 0
        """Chunks replayed since start."""
        self.waited_s = 0.0
        """Seconds replays spent waiting for the engine to be idle, since start."""

    def reference(
        self,
        prompt_tokens: Sequence[int],
        served_tokens: Sequence[int],
        sampling: SamplingParams,
        seed: int,
        dtype: str = OWN_DTYPE,
    ) -> Replay:
        """The target's own token, and its top-2 gap, at each served position (teacher-forced:
        `verifier.reference.replay`), in `dtype`'s weights. InvalidArgumentError for a
        rejection-rule sampled request, an unknown `dtype`, a bad token id or seed, or more
        tokens than the replica's context holds."""
        check_reference_dtype(dtype)
        check_seed(seed)
        total = len(prompt_tokens) + len(served_tokens)
        if self._max_context_tokens is not None and total > self._max_context_tokens:
            raise InvalidArgumentError(
                f"prompt plus served tokens ({total}) exceed the replica's context of "
                f"{self._max_context_tokens} tokens"
            )
        model = self._fp32_target() if dtype == FLOAT32 else self._target
        gone = caller_gone()

        def before_chunk() -> None:
            waited = wait_until_idle(
                self._has_work, poll_s=self._poll_s, quiet_s=self._quiet_s, gone=gone
            )
            with self._lock:
                self.chunks += 1
                self.waited_s += waited

        return replay(
            model,
            prompt_tokens,
            served_tokens,
            sampling,
            seed,
            chunk_tokens=self._chunk_tokens,
            before_chunk=before_chunk,
        )

    def _fp32_target(self) -> LoadedModel:
        """The float32 copy of the target, made on first use (once, whoever asks first)."""
        with self._fp32_lock:
            if self._fp32 is None:
                self._fp32 = fp32_copy(self._target)
            return self._fp32
