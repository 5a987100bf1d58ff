"""What a model runner is, and the block accounting every runner builds on.

`SequenceWork` (one sequence's new tokens in a step), `ModelRunner` (the protocol the engine
steps), `PoolExhaustedError` (a step's blocks do not fit) and `BlockAccountedRunner` (the base
class that counts KV memory in blocks, checks a step and reserves its blocks).

Contract: this module loads no model and knows no concrete runner, so that runners build on it
from either side of model loading: `cluster.runtime.runner` (paged and serial, and
`build_runner`, which needs `cluster.runtime.models`) and `cluster.runtime.sim_model` (the
simulated device's, which `cluster.runtime.models` loads). `cluster.runtime.runner` re-exports
its names.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel

from cluster.runtime.errors import InvalidArgumentError, ResourceExhaustedError
from cluster.runtime.kv_pool import BlockAllocator, num_input_ids
from cluster.runtime.quantize import output_width


@dataclass(frozen=True)
class SequenceWork:
    """New tokens of one sequence for one step, and where their logits are wanted."""

    seq_id: str
    tokens: tuple[int, ...]
    """Appended at the sequence's current length (>= 1 token)."""
    logits_at: tuple[int, ...]
    """Ascending indices into `tokens` whose next-token logits are returned (may be empty: a
    middle prefill chunk)."""


class PoolExhaustedError(ResourceExhaustedError):
    """The step's new KV blocks do not fit in the free blocks; nothing was changed."""


class ModelRunner(Protocol):
    kind: str
    """"paged", "serial" or "sim"."""
    block_size: int
    num_blocks: int

    @property
    def num_free_blocks(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    def length(self, seq_id: str) -> int: ...
    def blocks_needed(self, seq_id: str, new_length: int) -> int: ...
    def sequences(self) -> tuple[str, ...]: ...
    def num_blocks_of(self, seq_id: str) -> int: ...
    def forward(self, batch: Sequence[SequenceWork]) -> torch.Tensor: ...
    def truncate(self, seq_id: str, length: int) -> None: ...
    def release(self, seq_id: str) -> None: ...
    def fork(self, parent: str, child: str, length: int) -> None: ...


def _supports_logits_to_keep(model: PreTrainedModel) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


class BlockAccountedRunner:
    """The base of every runner: a `ModelRunner` over `model` whose KV memory is counted in
    `allocator`'s blocks. It keeps each sequence's length and blocks, validates a step's items,
    and reserves a step's blocks all or nothing (`PoolExhaustedError`, nothing changed).

    A subclass sets `kind` and supplies `forward`, `truncate` and `release`. Its `forward`
    returns `_empty_logits()` for an empty batch, calls `_reserve(batch)` before it runs
    anything, and once the step has run commits each item's new length in `_blocks` (the
    allocator), or undoes the reservations if it failed; its `truncate` and `release` pass on
    to `_blocks` as well as dropping whatever the subclass holds per sequence.
    """

    kind = ""

    def __init__(self, model: PreTrainedModel, allocator: BlockAllocator) -> None:
        self.model = model
        self.device = model.device
        self.block_size = allocator.block_size
        self.num_blocks = allocator.num_blocks
        self._blocks = allocator
        self._keep_rows_in_model = _supports_logits_to_keep(model)
        self._vocab_size = output_width(model)
        self._num_input_ids = num_input_ids(model)

    @property
    def num_free_blocks(self) -> int:
        return self._blocks.num_free_blocks

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def length(self, seq_id: str) -> int:
        return self._blocks.length(seq_id)

    def blocks_needed(self, seq_id: str, new_length: int) -> int:
        return self._blocks.blocks_needed(seq_id, new_length)

    def sequences(self) -> tuple[str, ...]:
        """The sequences held, oldest first (`BlockAllocator.sequences`)."""
        return self._blocks.sequences()

    def num_blocks_of(self, seq_id: str) -> int:
        return self._blocks.num_blocks_of(seq_id)

    def _check(self, batch: Sequence[SequenceWork]) -> None:
        if len({w.seq_id for w in batch}) != len(batch):
            raise InvalidArgumentError("a step takes at most one item per sequence")
        for w in batch:
            if not w.tokens:
                raise InvalidArgumentError(f"sequence {w.seq_id!r}: a step item needs tokens")
            if min(w.tokens) < 0 or max(w.tokens) >= self._num_input_ids:
                raise InvalidArgumentError(
                    f"sequence {w.seq_id!r}: token ids must be in 0..{self._num_input_ids - 1}"
                )
            if w.logits_at and (
                w.logits_at[0] < 0
                or w.logits_at[-1] >= len(w.tokens)
                or list(w.logits_at) != sorted(set(w.logits_at))
            ):
                raise InvalidArgumentError(
                    f"sequence {w.seq_id!r}: logits_at must be ascending indices in "
                    f"0..{len(w.tokens) - 1}, got {list(w.logits_at)}"
                )

    def _reserve(self, batch: Sequence[SequenceWork]) -> list[str]:
        """Take the step's blocks (all or nothing); the ids of sequences new to the runner."""
        self._check(batch)
        new_ids = [w.seq_id for w in batch if w.seq_id not in self._blocks]
        lengths = {w.seq_id: self._blocks.length(w.seq_id) + len(w.tokens) for w in batch}
        if not self._blocks.reserve_many(lengths):
            need = sum(self._blocks.blocks_needed(s, n) for s, n in lengths.items())
            raise PoolExhaustedError(
                f"KV memory full: the step needs {need} more blocks of {self.block_size} "
                f"tokens, {self._blocks.num_free_blocks} of {self.num_blocks} are free"
            )
        return new_ids

    def fork(self, parent: str, child: str, length: int) -> None:
        """Start `child` as a copy of `parent`'s first `length` positions (its K/V copied into
        blocks of its own), so that steps can extend the two apart: the branches of a draft.
        Raises `PoolExhaustedError` (nothing changed) if its blocks do not fit."""
        with torch.inference_mode():
            copies = self._blocks.fork(parent, child, length)
        if copies is None:
            raise PoolExhaustedError(
                f"KV memory full: a fork of {length} positions needs "
                f"{self._blocks.blocks_needed(child, length)} blocks of {self.block_size} "
                f"tokens, {self._blocks.num_free_blocks} of {self.num_blocks} are free"
            )
        self._forked(parent, child, length)

    def _forked(self, parent: str, child: str, length: int) -> None:
        """What the subclass holds per sequence, copied for a fork (the blocks are)."""

    def _empty_logits(self) -> torch.Tensor:
        return torch.empty(0, self._vocab_size, dtype=torch.float32, device=self.device)
