"""Paged KV memory: fixed-size token blocks, a free list and one block table per sequence.

`BlockAllocator` is the bookkeeping alone (which blocks each sequence holds and how many of its
positions are valid); `KVBlockPool` adds the K/V storage the paged attention reads and writes.
Both runners account memory through a `BlockAllocator`, so admission works the same whatever
runner a replica picked.

Contract:
- a sequence grows in two phases: `reserve(seq, new_length)` takes the blocks (atomic: all or
  nothing, `False` when they do not fit), `commit(seq, new_length)` records that the positions
  now hold valid K/V (after the forward pass succeeded);
- `truncate(seq, length)` is the rollback: whole blocks past `ceil(length / block_size)` go back
  to the free list and nothing is copied (stale K/V past the length is never read, and is
  overwritten when the sequence grows again); growing beyond the length is an error;
- `release(seq)` returns every block of the sequence; an unknown id is a no-op;
- storage (`KVBlockPool.key` / `.value`, `[layers, num_blocks * block_size, kv_heads,
  head_dim]`) is allocated once, zero-filled (padding reads of never-written slots stay finite),
  and never copied whole. Slot `block * block_size + offset` is the same in every layer, so one
  slot tensor per step serves all layers; per layer it reshapes without a copy to the paged
  layout `[num_blocks, block_size, kv_heads, head_dim]` that paged kernels take.

`pool_blocks` sizes a pool in blocks from a byte budget (or a fraction of the device's free
memory, `free_memory_bytes`), capped at what the replica could ever use.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence

import torch
from transformers import PreTrainedModel

from cluster.runtime.errors import InvalidArgumentError

logger = logging.getLogger(__name__)


def blocks_for(length: int, block_size: int) -> int:
    """Blocks needed to hold `length` positions."""
    return -(-length // block_size)


class BlockAllocator:
    """Block tables and committed lengths over `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, *, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise InvalidArgumentError(
                f"a KV pool needs at least one block of at least one token, got "
                f"{num_blocks} blocks of {block_size} tokens"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        # pop() hands out the lowest free id first, so a fresh pool fills from the front.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}
        self._lengths: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_sequences(self) -> int:
        return len(self._tables)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tables

    def length(self, seq_id: str) -> int:
        """Committed length of `seq_id`; 0 for an unknown sequence."""
        return self._lengths.get(seq_id, 0)

    def capacity(self, seq_id: str) -> int:
        """Positions the blocks `seq_id` holds can store (reserved, committed or not)."""
        return len(self._tables.get(seq_id, ())) * self.block_size

    def sequences(self) -> tuple[str, ...]:
        """Ids of the sequences held (blocks or not), oldest first: in the order they first
        reserved blocks (a truncate to 0 keeps a sequence's place; a release forgets it)."""
        return tuple(self._tables)

    def num_blocks_of(self, seq_id: str) -> int:
        """Blocks `seq_id` holds (0 for an unknown sequence)."""
        return len(self._tables.get(seq_id, ()))

    def table(self, seq_id: str) -> tuple[int, ...]:
        """The block ids of `seq_id`, in position order."""
        return tuple(self._tables.get(seq_id, ()))

    def blocks_needed(self, seq_id: str, new_length: int) -> int:
        """Blocks to take from the free list for `seq_id` to hold `new_length` positions."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, blocks_for(new_length, self.block_size) - have)

    def reserve(self, seq_id: str, new_length: int) -> bool:
        """Grow `seq_id`'s table to hold `new_length` positions; False (and no change) if full."""
        return self.reserve_many({seq_id: new_length})

    def reserve_many(self, new_lengths: Mapping[str, int]) -> bool:
        """`reserve` for several sequences at once: all of them, or (False) none."""
        needs = {seq: self.blocks_needed(seq, length) for seq, length in new_lengths.items()}
        if sum(needs.values()) > len(self._free):
            return False
        for seq_id, need in needs.items():
            table = self._tables.setdefault(seq_id, [])
            table.extend(self._free.pop() for _ in range(need))
            self._lengths.setdefault(seq_id, 0)
        return True

    def commit(self, seq_id: str, new_length: int) -> None:
        """Record that positions `< new_length` of `seq_id` hold valid K/V."""
        if not 0 <= new_length <= self.capacity(seq_id):
            raise InvalidArgumentError(
                f"cannot commit {seq_id} to length {new_length}: {self.capacity(seq_id)} "
                "positions reserved"
            )
        self._lengths[seq_id] = new_length

    def truncate(self, seq_id: str, length: int) -> None:
        """Roll back: keep positions `< length`, free whole blocks past it. No copy.

        Also frees blocks reserved past the committed length (`truncate(seq, length(seq))`
        undoes a reservation whose forward pass failed).
        """
        current = self.length(seq_id)
        if length < 0 or length > current:
            raise InvalidArgumentError(
                f"cannot truncate sequence {seq_id!r} of length {current} to {length}: "
                f"the length must be in 0..{current}"
            )
        table = self._tables.get(seq_id)
        if table is None:
            return  # unknown sequence, length 0: nothing to do, and no entry is created
        keep = blocks_for(length, self.block_size)
        self._free.extend(reversed(table[keep:]))
        del table[keep:]
        self._lengths[seq_id] = length

    def fork(self, parent: str, child: str, length: int) -> list[tuple[int, int]] | None:
        """Start `child` as a copy of `parent`'s first `length` positions, in blocks of its
        own; the (parent block, child block) pairs whose contents are copied. None (and no
        change) if the free blocks do not hold them."""
        if child in self._tables:
            raise InvalidArgumentError(f"cannot fork into {child!r}: that sequence exists")
        if not 0 <= length <= self.length(parent):
            raise InvalidArgumentError(
                f"cannot fork {length} positions of {parent!r}, which holds {self.length(parent)}"
            )
        need = blocks_for(length, self.block_size)
        if need > len(self._free):
            return None
        copies = list(
            zip(
                self._tables.get(parent, [])[:need],
                [self._free.pop() for _ in range(need)],
                strict=True,
            )
        )
        self._tables[child] = [block for _, block in copies]
        self._lengths[child] = length
        return copies

    def release(self, seq_id: str) -> None:
        """Return every block of `seq_id` and forget it; an unknown id is a no-op."""
        self._free.extend(reversed(self._tables.pop(seq_id, [])))
        self._lengths.pop(seq_id, None)

    def undo_reservations(self, seq_ids: Iterable[str], new_ids: Iterable[str]) -> None:
        """Undo `reserve_many` after a failed step: `new_ids` (unknown before) are released,
        the others keep their committed length and lose the blocks reserved past it."""
        fresh = set(new_ids)
        for seq_id in seq_ids:
            if seq_id in fresh:
                self.release(seq_id)
            else:
                self.truncate(seq_id, self.length(seq_id))

    def block_tables(self, seq_ids: Sequence[str]) -> torch.Tensor:
        """`[len(seq_ids), max blocks]` int64 (CPU) of the sequences' block ids, padded with 0."""
        tables = [self._tables.get(seq_id, []) for seq_id in seq_ids]
        width = max((len(t) for t in tables), default=0)
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)


class KVBlockPool(BlockAllocator):
    """A `BlockAllocator` with K/V storage for every layer (see the module docstring)."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(num_blocks=num_blocks, block_size=block_size)
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        # Allocated, not written: on a host the pages are committed only as blocks are first
        # used (below), so a pool sized for the worst case costs memory only as sessions grow.
        self.key = torch.empty(shape, dtype=dtype, device=device)
        self.value = torch.empty(shape, dtype=dtype, device=device)
        self._zeroed_blocks = 0
        """Blocks `< _zeroed_blocks` have been zeroed. Padding slots are read (masked) and a
        masked NaN would still poison attention, so every block is zeroed before first use;
        the free list hands out low ids first, so this mark rises block by block."""

    def reserve_many(self, new_lengths: Mapping[str, int]) -> bool:
        if not super().reserve_many(new_lengths):
            return False
        self._zero_through(max((max(self._tables[s], default=-1) for s in new_lengths), default=-1))
        return True

    def fork(self, parent: str, child: str, length: int) -> list[tuple[int, int]] | None:
        """`BlockAllocator.fork`, copying the K/V of each of the parent's blocks (whole
        blocks: positions past `length` in the last are masked until overwritten)."""
        copies = super().fork(parent, child, length)
        if not copies:
            return copies
        self._zero_through(max(block for _, block in copies))  # never zeroed after the copy
        size = self.block_size
        offsets = torch.arange(size)
        source = torch.cat([block * size + offsets for block, _ in copies]).to(self.key.device)
        target = torch.cat([block * size + offsets for _, block in copies]).to(self.key.device)
        self.key[:, target] = self.key[:, source]
        self.value[:, target] = self.value[:, source]
        return copies

    def _zero_through(self, highest: int) -> None:
        """Zero every block up to `highest` not zeroed yet."""
        if highest >= self._zeroed_blocks:
            start, stop = self._zeroed_blocks * self.block_size, (highest + 1) * self.block_size
            self.key[:, start:stop].zero_()
            self.value[:, start:stop].zero_()
            self._zeroed_blocks = highest + 1

    @classmethod
    def for_model(
        cls, model: PreTrainedModel, *, num_blocks: int, block_size: int = 16
    ) -> KVBlockPool:
        layers, kv_heads, head_dim = kv_shape(model)
        return cls(
            num_layers=layers,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=model.dtype,
            device=model.device,
        )

    @property
    def num_bytes(self) -> int:
        return 2 * self.key.numel() * self.key.element_size()


def kv_shape(model: PreTrainedModel) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of the model's text config."""
    config = model.config.get_text_config()
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return int(config.num_hidden_layers), int(kv_heads), int(head_dim)


def kv_bytes_per_token(model: PreTrainedModel) -> int:
    """K/V bytes one token takes in every layer: layers x 2 x kv heads x head dim x itemsize."""
    layers, kv_heads, head_dim = kv_shape(model)
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    return layers * 2 * kv_heads * head_dim * itemsize


def num_input_ids(model: PreTrainedModel) -> int:
    """How many token ids the model's input embeddings accept."""
    embeddings = model.get_input_embeddings()
    count = getattr(embeddings, "num_embeddings", None)
    return int(count if count is not None else model.config.get_text_config().vocab_size)


def free_memory_bytes(device: torch.device) -> int:
    """Memory free for a KV pool on `device`: CUDA's free memory, or the host's available."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        try:
            with open("/proc/meminfo", encoding="ascii") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    raise InvalidArgumentError(f"cannot measure free memory on {device}: set kv_cache_bytes")


def pool_blocks(
    model: PreTrainedModel,
    *,
    kv_cache_bytes: int,
    kv_cache_fraction: float,
    max_tokens_needed: int | None,
    max_sequence_tokens: int | None,
    block_size: int,
) -> int:
    """The pool size in blocks (see `build_runner`)."""
    if kv_cache_bytes < 0 or not 0 < kv_cache_fraction <= 1 or block_size < 1:
        raise InvalidArgumentError(
            "kv_cache_bytes must be >= 0, kv_cache_fraction in (0, 1] and block_size >= 1"
        )
    block_bytes = kv_bytes_per_token(model) * block_size
    budget = kv_cache_bytes or int(kv_cache_fraction * free_memory_bytes(model.device))
    num_blocks = budget // block_bytes
    if max_tokens_needed is not None:
        num_blocks = min(num_blocks, blocks_for(max_tokens_needed, block_size))
    if max_sequence_tokens is None:
        config = model.config.get_text_config()
        max_sequence_tokens = int(getattr(config, "max_position_embeddings", 0) or block_size)
        if max_tokens_needed is not None:
            max_sequence_tokens = min(max_sequence_tokens, max_tokens_needed)
    floor = max(1, blocks_for(max_sequence_tokens, block_size))
    if num_blocks < floor:
        logger.warning(
            "KV budget of %d bytes holds %d blocks; using %d to fit one %d-token sequence",
            budget, num_blocks, floor, max_sequence_tokens,
        )  # fmt: skip
    return max(num_blocks, floor)
