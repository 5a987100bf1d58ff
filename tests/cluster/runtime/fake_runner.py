"""A bookkeeping double of a model runner, for tests of the engine loop and the session table.

`RecordingRunner` accounts KV blocks like the paged runner and records every step; each logit
row it returns encodes the sequence and the position it was computed at, so a test can see
which tokens ran in which step. `PrefillingTable` is a `SessionTable` whose `open` also runs the
prompt through such a runner, as the components' open task does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from cluster.runtime.block_runner import PoolExhaustedError, SequenceWork
from cluster.runtime.session import ReplicaSession, SessionTable

VOCAB = 4


class RecordingRunner:
    """Bookkeeping like a paged runner's; row = [seq hash, position, step, 0]."""

    kind = "paged"

    def __init__(self, num_blocks: int = 64, block_size: int = 4) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.lengths: dict[str, int] = {}
        self.steps: list[list[SequenceWork]] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        """Set when a forward pass starts (before it waits for `gate`)."""
        self.fail_next = False
        self.step_s = 0.0
        """Seconds each forward pass takes (a sleep), as a real model's would."""

    def _blocks(self, length: int) -> int:
        return -(-length // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - sum(self._blocks(n) for n in self.lengths.values())

    @property
    def vocab_size(self) -> int:
        return VOCAB

    def length(self, seq_id: str) -> int:
        return self.lengths.get(seq_id, 0)

    def blocks_needed(self, seq_id: str, new_length: int) -> int:
        return max(0, self._blocks(new_length) - self._blocks(self.length(seq_id)))

    def sequences(self) -> tuple[str, ...]:
        return tuple(self.lengths)

    def num_blocks_of(self, seq_id: str) -> int:
        return self._blocks(self.length(seq_id))

    def forward(self, batch: Sequence[SequenceWork]) -> torch.Tensor:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait()
        if self.step_s:
            time.sleep(self.step_s)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("device fell over")
        need = sum(
            self.blocks_needed(w.seq_id, self.length(w.seq_id) + len(w.tokens)) for w in batch
        )
        if need > self.num_free_blocks:
            raise PoolExhaustedError("full")
        self.steps.append(list(batch))
        rows = []
        for work in batch:
            start = self.length(work.seq_id)
            for i in work.logits_at:
                rows.append([float(hash(work.seq_id) % 1000), float(start + i), len(self.steps), 0])
            self.lengths[work.seq_id] = start + len(work.tokens)
        return torch.tensor(rows, dtype=torch.float32).reshape(-1, VOCAB)

    def truncate(self, seq_id: str, length: int) -> None:
        self.lengths[seq_id] = length

    def release(self, seq_id: str) -> None:
        self.lengths.pop(seq_id, None)


class PrefillingTable(SessionTable):
    """A session table over a `RecordingRunner` whose `open` prefills the prompt."""

    def __init__(
        self, model: Any, max_sessions: int, max_context_tokens: int, **kwargs: Any
    ) -> None:
        self.recording = RecordingRunner(num_blocks=4096, block_size=16)
        super().__init__(model, self.recording, max_sessions, max_context_tokens, **kwargs)

    def open(
        self, session_id: str, prompt_tokens: Sequence[int], *args: Any, **kwargs: Any
    ) -> ReplicaSession:
        session = super().open(session_id, prompt_tokens, *args, **kwargs)
        work = session.kv.work(0, upto=len(prompt_tokens) - 1)
        if work is not None:
            self.recording.forward([work])
        return session
