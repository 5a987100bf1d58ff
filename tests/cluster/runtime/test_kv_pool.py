"""KV pool bookkeeping (reserve, commit, truncate, release, exhaustion) and step packing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.runtime import tiny
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.kv_pool import BlockAllocator, KVBlockPool, kv_bytes_per_token
from cluster.runtime.paged_attention import pack_step


def test_reserve_commit_truncate_release_return_blocks_to_baseline() -> None:
    pool = BlockAllocator(num_blocks=8, block_size=4)
    assert pool.reserve("a", 9)  # 3 blocks
    assert pool.num_free_blocks == 5
    assert pool.length("a") == 0  # reserved, not committed
    pool.commit("a", 9)
    assert pool.length("a") == 9
    assert pool.blocks_needed("a", 12) == 0  # the third block has room up to 12
    assert pool.blocks_needed("a", 13) == 1
    assert pool.reserve("b", 4)
    pool.commit("b", 4)
    assert pool.num_free_blocks == 4
    assert set(pool.table("a")).isdisjoint(pool.table("b"))

    pool.truncate("a", 5)  # 9 -> 5: keeps 2 blocks, frees 1
    assert (pool.length("a"), len(pool.table("a")), pool.num_free_blocks) == (5, 2, 5)
    pool.truncate("a", 4)  # exactly one block left
    assert (len(pool.table("a")), pool.num_free_blocks) == (1, 6)
    pool.truncate("a", 4)  # same length: no change
    assert pool.num_free_blocks == 6
    pool.truncate("a", 0)
    assert (pool.length("a"), pool.table("a"), pool.num_free_blocks) == (0, (), 7)
    assert "a" in pool  # truncated to 0 but still known

    pool.release("a")
    pool.release("b")
    pool.release("never-seen")  # no-op
    assert pool.num_free_blocks == 8
    assert pool.num_sequences == 0
    assert pool.length("a") == 0


def test_exhaustion_changes_nothing() -> None:
    pool = BlockAllocator(num_blocks=4, block_size=2)
    assert pool.reserve("a", 5)  # 3 blocks
    pool.commit("a", 5)
    before = (pool.num_free_blocks, pool.table("a"), pool.length("a"))
    assert not pool.reserve_many({"a": 7, "b": 1})  # 1 + 1 blocks needed, 1 free
    assert (pool.num_free_blocks, pool.table("a"), pool.length("a")) == before
    assert "b" not in pool
    assert not pool.reserve("b", 3)
    assert "b" not in pool
    assert pool.reserve_many({"a": 6, "b": 2})  # a fits in its third block, b takes the last
    assert pool.num_free_blocks == 0


def test_truncate_and_commit_reject_bad_lengths() -> None:
    pool = BlockAllocator(num_blocks=4, block_size=2)
    pool.reserve("a", 3)
    pool.commit("a", 3)
    with pytest.raises(InvalidArgumentError, match=r"0\.\.3"):
        pool.truncate("a", 4)
    with pytest.raises(InvalidArgumentError):
        pool.truncate("a", -1)
    with pytest.raises(InvalidArgumentError):
        pool.commit("a", 5)  # only 4 positions reserved
    with pytest.raises(InvalidArgumentError):
        pool.truncate("unknown", 1)
    pool.truncate("unknown", 0)  # length 0 to 0: no-op, creates nothing
    assert "unknown" not in pool
    with pytest.raises(InvalidArgumentError):
        BlockAllocator(num_blocks=0, block_size=2)


def test_undo_reservations_after_a_failed_step() -> None:
    pool = BlockAllocator(num_blocks=8, block_size=2)
    pool.reserve("old", 3)
    pool.commit("old", 3)
    assert pool.reserve_many({"old": 8, "new": 5})
    assert pool.num_free_blocks == 1
    pool.undo_reservations(["old", "new"], new_ids=["new"])
    assert (pool.length("old"), len(pool.table("old")), pool.num_free_blocks) == (3, 2, 6)
    assert "new" not in pool


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["reserve", "truncate", "release"]), st.integers(0, 2),
                  st.integers(0, 12)),
        max_size=30,
    )
)  # fmt: skip
def test_blocks_are_conserved_under_any_operations(ops: list[tuple[str, int, int]]) -> None:
    pool = BlockAllocator(num_blocks=6, block_size=3)
    for op, seq, n in ops:
        seq_id = f"s{seq}"
        if op == "reserve":
            length = pool.length(seq_id) + n
            if pool.reserve(seq_id, length):
                pool.commit(seq_id, length)
        elif op == "truncate":
            pool.truncate(seq_id, min(n, pool.length(seq_id)))
        else:
            pool.release(seq_id)
        held = [block for s in ("s0", "s1", "s2") for block in pool.table(s)]
        assert len(held) == len(set(held))  # no block is held twice
        assert len(held) + pool.num_free_blocks == 6  # and none is lost
        for s in ("s0", "s1", "s2"):
            assert len(pool.table(s)) == -(-pool.length(s) // 3)  # whole blocks only


def test_pool_storage_and_size() -> None:
    model = tiny.build_target()
    pool = KVBlockPool.for_model(model, num_blocks=5, block_size=4)
    # tiny target: 4 layers, 2 kv heads, head dim 64 / 4 = 16, fp32.
    assert pool.key.shape == pool.value.shape == (4, 20, 2, 16)
    assert pool.key.dtype == torch.float32
    pool.key.fill_(float("nan"))  # what uninitialised memory may hold
    pool.value.fill_(float("nan"))
    pool.reserve("x", 6)  # blocks 0 and 1 are zeroed on first use: padding reads stay finite
    assert not pool.key[:, :8].any() and not pool.value[:, :8].any()
    assert pool.key[:, 8:].isnan().all()  # the rest is left untouched (no pages committed)
    pool.release("x")
    assert kv_bytes_per_token(model) == 4 * 2 * 2 * 16 * 4
    assert pool.num_bytes == 20 * kv_bytes_per_token(model)
    tables = pool.block_tables(["y"])
    assert tables.shape == (1, 0)


def test_pack_step_indices() -> None:
    pool = KVBlockPool(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=6, block_size=2,
                       dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    pool.reserve("a", 3)
    pool.commit("a", 3)  # a: blocks 0, 1
    pool.reserve_many({"a": 5, "b": 2})  # a: + block 2; b: block 3
    step = pack_step(
        key_cache=pool.key,
        value_cache=pool.value,
        block_tables=pool.block_tables(["a", "b"]),
        block_size=2,
        past_lengths=[3, 0],
        query_lengths=[2, 2],
    )
    # a's new positions 3, 4 -> slots 3 (block 1, offset 1), 4 (block 2, offset 0); b: 6, 7.
    assert step.write_slots.tolist() == [3, 4, 6, 7]
    assert step.positions.tolist() == [3, 4, 0, 1]
    assert step.query_index.tolist() == [[0, 1], [2, 3]]
    assert step.kv_slots.tolist() == [[0, 1, 2, 3, 4], [6, 7, 0, 0, 0]]
    assert step.unpad_index.tolist() == [0, 1, 2, 3]
    assert step.mask[:, 0].int().tolist() == [
        [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]],
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]],
    ]
    window = step.mask_for(2)  # keys j > position - 2
    assert window[:, 0].int().tolist() == [
        [[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]],
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]],
    ]
    assert step.mask_for(2) is window  # cached for the step
    assert step.mask_for(None) is step.mask


def test_pack_step_pads_short_sequences() -> None:
    pool = KVBlockPool(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=4, block_size=4,
                       dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    pool.reserve_many({"a": 3, "b": 1})
    step = pack_step(
        key_cache=pool.key,
        value_cache=pool.value,
        block_tables=pool.block_tables(["a", "b"]),
        block_size=4,
        past_lengths=[0, 0],
        query_lengths=[3, 1],
    )
    assert step.query_index.tolist() == [[0, 1, 2], [3, 0, 0]]
    assert step.unpad_index.tolist() == [0, 1, 2, 3]
    assert step.query_positions.tolist() == [[0, 1, 2], [0, 0, 0]]
    # b's padding queries see key 0 only: every softmax row is finite.
    assert step.mask[1, 0].int().tolist() == [[1, 0, 0], [1, 0, 0], [1, 0, 0]]
