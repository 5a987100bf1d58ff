"""KVSession: cached logits equal a full forward, whatever the prefix reuse and rollbacks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from verifier.runtime.errors import InvalidArgumentError
from verifier.runtime.kv_cache import KVSession, common_prefix_length
from verifier.runtime.models import LoadedModel

# fp32 on the CPU: a cached forward and a full forward differ only by summation order.
ATOL = 1e-4


def full_logits(model: LoadedModel, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.model(torch.tensor([tokens])).logits[0]


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


def test_block_logits_match_full_forward(tiny_target: LoadedModel, sequence: list[int]) -> None:
    session = KVSession(tiny_target.model, tiny_target.device)
    reference = full_logits(tiny_target, sequence)
    session.prefill(sequence[:20])
    assert session.num_cached_tokens == 20
    block = session.logits(sequence[:26], num_logits=6)
    assert block.shape == (6, tiny_target.vocab_size)
    torch.testing.assert_close(block, reference[20:26], atol=ATOL, rtol=0)
    assert session.cached_tokens == tuple(sequence[:26])


def test_divergent_tokens_are_rolled_back(tiny_target: LoadedModel, sequence: list[int]) -> None:
    session = KVSession(tiny_target.model, tiny_target.device)
    session.logits([*sequence[:30], 1, 2, 3], num_logits=4)  # a block that will be rejected
    reference = full_logits(tiny_target, sequence)
    after = session.logits(sequence[:40], num_logits=10)
    torch.testing.assert_close(after, reference[30:40], atol=ATOL, rtol=0)
    assert session.num_cached_tokens == 40


def test_explicit_rollback_then_extend(tiny_target: LoadedModel, sequence: list[int]) -> None:
    session = KVSession(tiny_target.model, tiny_target.device)
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
    tiny_target: LoadedModel, sequence: list[int]
) -> None:
    session = KVSession(tiny_target.model, tiny_target.device)
    session.prefill(sequence[:10])
    reference = full_logits(tiny_target, sequence[:10])
    torch.testing.assert_close(session.logits(sequence[:10], 1), reference[9:10], atol=ATOL, rtol=0)
    assert session.num_cached_tokens == 10


def test_bad_arguments(tiny_target: LoadedModel) -> None:
    session = KVSession(tiny_target.model, tiny_target.device)
    with pytest.raises(InvalidArgumentError, match="num_logits"):
        session.logits([1, 2], num_logits=3)
    with pytest.raises(InvalidArgumentError, match="num_logits"):
        session.logits([1, 2], num_logits=0)
    with pytest.raises(InvalidArgumentError, match="rollback"):
        session.rollback(-1)
