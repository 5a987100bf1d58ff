"""SequenceKV over a paged runner: cached logits equal a full forward, whatever the prefix reuse
and rollbacks, and rolled-back blocks go back to the pool."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cluster.runtime.block_runner import ModelRunner
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.kv_cache import SequenceKV, common_prefix_length
from cluster.runtime.model_spec import TINY_TARGET, ModelSpec
from cluster.runtime.models import LoadedModel, load_model
from cluster.runtime.runner import build_runner

# fp32 on the CPU: a cached forward and a full forward differ only by summation order.
ATOL = 1e-4


def full_logits(model: LoadedModel, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.model(torch.tensor([tokens])).logits[0]


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    # A model object of its own: the paged runner switches its attention function.
    return build_runner(load_model(ModelSpec(TINY_TARGET, device="cpu")), kv_cache_bytes=8 << 20)


class KVSession:
    """A session's sequence driven directly, as a component would: change the sequence, ask
    for `work`, run one forward (the runner's length then says what is cached)."""

    def __init__(self, runner: ModelRunner, seq_id: str) -> None:
        self.runner = runner
        runner.release(seq_id)
        self.kv = SequenceKV(runner, seq_id)

    @property
    def num_cached_tokens(self) -> int:
        return self.kv.num_cached_tokens

    @property
    def cached_tokens(self) -> tuple[int, ...]:
        return self.kv.cached_tokens

    def rollback(self, length: int) -> None:
        self.kv.rollback(length)

    def logits(self, tokens: list[int], num_logits: int) -> torch.Tensor:
        self.kv.commit_at(0, tokens)
        work = self.kv.work(num_logits)
        assert work is not None
        return self.runner.forward([work])

    def prefill(self, tokens: list[int]) -> None:
        self.kv.commit_at(0, tokens)
        work = self.kv.work(0)
        if work is not None:
            self.runner.forward([work])


@pytest.fixture
def sequence() -> list[int]:
    return [(i * 37 + 11) % 256 for i in range(60)]


def test_common_prefix_length() -> None:
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([5], [6]) == 0
    assert common_prefix_length((1, 2, 3), [1, 2, 3, 4]) == 3  # a tuple against a list


@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40))
def test_common_prefix_length_matches_a_plain_loop(a: list[int], b: list[int]) -> None:
    expected = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                    min(len(a), len(b)))  # fmt: skip
    assert common_prefix_length(a, b) == expected
    assert common_prefix_length(a, a + b) == len(a)


def test_block_logits_match_full_forward(
    tiny_target: LoadedModel, runner: ModelRunner, sequence: list[int]
) -> None:
    session = KVSession(runner, "s")
    reference = full_logits(tiny_target, sequence)
    session.prefill(sequence[:20])
    assert session.num_cached_tokens == 20
    block = session.logits(sequence[:26], num_logits=6)
    assert block.shape == (6, tiny_target.vocab_size)
    torch.testing.assert_close(block, reference[20:26], atol=ATOL, rtol=0)
    assert session.cached_tokens == tuple(sequence[:26])


def test_divergent_tokens_are_rolled_back(
    tiny_target: LoadedModel, runner: ModelRunner, sequence: list[int]
) -> None:
    session = KVSession(runner, "s")
    session.logits([*sequence[:30], 1, 2, 3], num_logits=4)  # a block that will be rejected
    reference = full_logits(tiny_target, sequence)
    after = session.logits(sequence[:40], num_logits=10)
    torch.testing.assert_close(after, reference[30:40], atol=ATOL, rtol=0)
    assert session.num_cached_tokens == 40


def test_explicit_rollback_then_extend(
    tiny_target: LoadedModel, runner: ModelRunner, sequence: list[int]
) -> None:
    session = KVSession(runner, "s")
    session.prefill(sequence[:50])
    session.rollback(25)
    assert session.num_cached_tokens == 25
    reference = full_logits(tiny_target, sequence)
    torch.testing.assert_close(
        session.logits(sequence, num_logits=5), reference[55:60], atol=ATOL, rtol=0
    )
    session.rollback(0)
    assert session.num_cached_tokens == 0
    torch.testing.assert_close(session.logits(sequence[:10], 1), reference[9:10], atol=ATOL, rtol=0)


def test_fully_cached_sequence_is_recomputed_for_its_logits(
    tiny_target: LoadedModel, runner: ModelRunner, sequence: list[int]
) -> None:
    session = KVSession(runner, "s")
    session.prefill(sequence[:10])
    reference = full_logits(tiny_target, sequence[:10])
    torch.testing.assert_close(session.logits(sequence[:10], 1), reference[9:10], atol=ATOL, rtol=0)
    assert session.num_cached_tokens == 10


def test_bad_arguments(runner: ModelRunner) -> None:
    session = KVSession(runner, "s")
    with pytest.raises(InvalidArgumentError, match="num_logits"):
        session.logits([1, 2], num_logits=3)
    with pytest.raises(InvalidArgumentError, match="num_logits"):
        session.kv.work(num_logits=-1)
    with pytest.raises(InvalidArgumentError, match="upto"):
        session.kv.work(0, upto=3)
    with pytest.raises(InvalidArgumentError, match="rewritten"):
        session.kv.commit_at(3, [1])
    session.kv.commit_at(0, [])
    assert session.kv.work(num_logits=0) is None
    with pytest.raises(InvalidArgumentError, match="rollback"):
        session.rollback(-1)


def test_rollback_frees_whole_blocks(runner: ModelRunner, sequence: list[int]) -> None:
    session = KVSession(runner, "s")
    baseline = runner.num_free_blocks
    session.prefill(sequence[:50])  # 4 blocks of 16
    assert baseline - runner.num_free_blocks == 4
    session.rollback(17)  # positions 0..16: 2 blocks stay
    assert baseline - runner.num_free_blocks == 2
    session.kv.release()
    assert runner.num_free_blocks == baseline
    assert session.num_cached_tokens == 0


def test_a_step_that_never_ran_leaves_the_cache_as_the_runner_holds_it(
    runner: ModelRunner, sequence: list[int]
) -> None:
    session = KVSession(runner, "s")
    session.prefill(sequence[:20])
    session.kv.extend(sequence[20:30])
    assert session.kv.work(1) is not None  # plans 10 tokens; the step "fails"
    assert session.cached_tokens == tuple(sequence[:20])
    assert session.kv.length == 30 and session.kv.committed_length == 20


def test_one_record_committed_then_tentative_and_only_changed_positions_roll_back(
    tiny_target: LoadedModel, runner: ModelRunner, sequence: list[int]
) -> None:
    session = KVSession(runner, "s")
    kv = session.kv
    reference = full_logits(tiny_target, sequence)
    session.prefill(sequence[:20])
    kv.extend([*sequence[20:24], 7])  # a block of five drafts, the last one wrong
    block = session.runner.forward([kv.work(5)])  # type: ignore[list-item]
    torch.testing.assert_close(block[:4], reference[20:24], atol=ATOL, rtol=0)
    assert kv.committed_length == 20 and kv.num_cached_tokens == 25
    # The verdict: four accepted and a correction. The accepted drafts stay cached.
    kv.commit_at(20, sequence[20:25])
    assert kv.committed_tokens == tuple(sequence[:25])
    assert kv.num_cached_tokens == 24  # the wrong draft's position went
    row = session.runner.forward([kv.work(1)])  # type: ignore[list-item]
    torch.testing.assert_close(row, reference[24:25], atol=ATOL, rtol=0)
    # A tentative tail is forgotten, cached positions and all.
    kv.extend([1, 2, 3])
    session.runner.forward([kv.work(0)])  # type: ignore[list-item]
    assert kv.num_cached_tokens == 28
    kv.drop_tentative()
    assert kv.length == 25 and kv.num_cached_tokens == 25


def test_the_router_can_take_back_committed_tokens(
    tiny_target: LoadedModel, runner: ModelRunner, sequence: list[int]
) -> None:
    session = KVSession(runner, "s")
    session.prefill(sequence[:30])
    session.kv.commit_at(12, [9, 9])  # tokens 12.. were only assumed: the router undoes them
    assert session.kv.committed_tokens == (*sequence[:12], 9, 9)
    assert session.num_cached_tokens == 12
    reference = full_logits(tiny_target, [*sequence[:12], 9, 9])
    row = session.runner.forward([session.kv.work(1)])  # type: ignore[list-item]
    torch.testing.assert_close(row, reference[13:14], atol=ATOL, rtol=0)
