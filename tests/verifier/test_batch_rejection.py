"""Tests for verifier.batch_rejection, in the four kinds of docs/architecture.md, "Tests".

1. Exact greedy cases: hand-made rows and drafts, several sessions in one batch.
2. Seeded determinism, and bitwise equality per session with `rejection_sample` (plus
   `Verifier.verify`'s deferral) over random ragged batches, across two blocks so that rows
   deferred by the batch come back as stored rows.
3. A plain loop reference (one session, one position at a time), compared exactly, generator
   states included.
4. Statistics: in test_batch_rejection_statistics.py; invalid input in
   test_batch_rejection_checks.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest
import torch
from torch import Tensor

from cluster.runtime.sampling import logits_to_probs
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.sparse_distribution import SparseDistribution, to_dense, to_sparse
from tests.verifier.rejection_reference import reference_rejection_sample, seeded, token_ids
from verifier.batch_rejection import (
    BatchSession,
    DeferredRow,
    SessionOutcome,
    batch_rejection_sample,
)
from verifier.rejection import rejection_sample


def _one_hot(ids: list[int], vocab: int) -> Tensor:
    rows = torch.zeros(len(ids), vocab)  # [len(ids), vocab]
    rows[torch.arange(len(ids)), torch.tensor(ids, dtype=torch.int64)] = 1.0
    return rows


def _dense(row: DeferredRow, vocab: int) -> Tensor:  # [vocab]
    if isinstance(row, int):
        return _one_hot([row], vocab)[0]
    if isinstance(row, SparseDistribution):
        return to_dense([row], vocab)[0]
    return row


# ------------------------------------------------------------------- 1. exact greedy cases


def test_greedy_sessions_keep_the_matching_prefix_then_the_argmax() -> None:
    vocab = 6
    blocks = [  # (argmax at positions 0..k, draft, expected tokens, expected accepted)
        ([3, 1, 4, 2], [3, 1, 4], [3, 1, 4, 2], 3),  # all accepted, then the bonus argmax
        ([3, 1, 4, 2], [0, 1, 4], [3], 0),  # first rejected: the argmax replaces it
        ([3, 1, 4, 2], [3, 2, 4], [3, 1], 1),  # rejected in the middle
        ([5], [], [5], 0),  # k = 0: target-only decoding
    ]
    # Greedy rows may be logits (only the argmax is read) or one-hot p: use both.
    rows = [
        torch.randn(len(argmaxes), vocab, generator=seeded(index)) - 10 * (1 - hot)
        if index % 2
        else hot
        for index, (argmaxes, *_) in enumerate(blocks)
        for hot in [_one_hot(argmaxes, vocab)]
    ]
    outcomes = batch_rejection_sample(
        torch.cat(rows),
        token_ids(*(token for _, draft, *_ in blocks for token in draft)),
        [BatchSession(num_draft=len(draft), greedy=True) for _, draft, *_ in blocks],
    )
    expected = [SessionOutcome(accepted, tuple(tokens)) for _, _, tokens, accepted in blocks]
    assert outcomes == expected


def test_greedy_deferral_keeps_only_the_argmax_and_the_next_block_checks_against_it() -> None:
    vocab = 5
    first = batch_rejection_sample(
        _one_hot([1, 2, 4], vocab),
        token_ids(1, 2),
        [BatchSession(num_draft=2, greedy=True, defer_bonus=True)],
    )
    assert first == [SessionOutcome(2, (1, 2), deferred_row=4)]  # a token id, no row
    # Next block: position 0 is the stored row, so only positions 1..k come as rows.
    stored = first[0].deferred_row
    cases = [([4, 0], [0, 3], 2, (4, 0, 3)), ([2, 0], [3, 1], 0, (4,)), ([], [], 0, (4,))]
    for draft, argmaxes, accepted, tokens in cases:
        outcome = batch_rejection_sample(
            _one_hot(argmaxes, vocab),
            token_ids(*draft),
            [BatchSession(num_draft=len(draft), greedy=True, stored_row=stored)],
        )
        assert outcome == [SessionOutcome(accepted, tokens)], draft


def test_greedy_sessions_ignore_q_and_leave_their_generators_untouched() -> None:
    # p one-hot: p(x) = 1 passes and p(x) = 0 fails whatever q is, so no draw is needed.
    vocab = 3
    target = _one_hot([2, 0, 1], vocab)
    soft_q = torch.tensor([[0.2, 0.3, 0.5], [0.6, 0.2, 0.2]])
    for draft_probs in (soft_q, tuple(to_sparse(row) for row in soft_q)):
        generator = seeded(5)
        outcome = batch_rejection_sample(
            target,
            token_ids(2, 1),
            [BatchSession(2, greedy=True, generator=generator, draft_probs=draft_probs)],
        )
        assert outcome == [SessionOutcome(1, (2, 0))]
        assert torch.equal(generator.get_state(), seeded(5).get_state())


def test_an_empty_batch_returns_nothing() -> None:
    assert batch_rejection_sample(torch.zeros(0, 4), token_ids(), []) == []


# ------------------------------------------- 2. determinism, equality with the single path


@dataclass(frozen=True)
class _Session:
    """One session of a random block, as the single path and as the batch see it."""

    greedy: bool
    p: Tensor  # [k + 1, vocab]: the single path's target_probs (row 0 the kept row, if any)
    rows: Tensor  # the batch's rows: p, or logits for a greedy session; no row 0 if stored
    draft: Tensor  # [k]
    q: Tensor | None  # [k, vocab] dense, for the single path
    q_sent: Tensor | tuple[SparseDistribution, ...] | None  # as the batch gets it
    defer: bool
    stored: DeferredRow | None
    seed: int

    def batch_session(self, generator: torch.Generator | None) -> BatchSession:
        return BatchSession(
            num_draft=len(self.draft),
            greedy=self.greedy,
            generator=generator,
            draft_probs=self.q_sent,
            defer_bonus=self.defer,
            stored_row=self.stored,
        )


_TARGET_PARAMS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=1.2, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=12, top_p=0.95),
]


def _random_session(
    rng: random.Random, gen: torch.Generator, vocab: int, kept: tuple[Tensor, DeferredRow] | None
) -> _Session:
    """A session whose drafter is close to its target, so that whole blocks pass often;
    `kept` is (p row, its stored form) from a deferred previous block."""
    greedy = rng.random() < 0.3 if kept is None else isinstance(kept[1], int)
    k = rng.randint(0, 8)
    params = SamplingParams() if greedy else rng.choice(_TARGET_PARAMS)
    logits = 2 * torch.randn(k + 1, vocab, generator=gen)  # [k + 1, vocab]
    p = logits_to_probs(logits, params)
    if kept is not None:
        p[0] = kept[0]
    draft_logits = logits[:k] + 0.3 * torch.randn(k, vocab, generator=gen)
    kind = rng.choice(
        ["one-hot", "dense", "sparse"] if rng.random() < 0.5 or not greedy else ["one-hot"]
    )
    if kind == "one-hot":
        # The drafter's argmax, or the target's own token most of the time.
        draft = torch.where(
            torch.rand(k, generator=gen) < 0.8, p[:k].argmax(-1), draft_logits.argmax(-1)
        )
        q, q_sent = None, None
    else:
        q = logits_to_probs(draft_logits, rng.choice(_TARGET_PARAMS))
        draft = torch.multinomial(q, 1, generator=gen).flatten() if k else token_ids()
        q_sent = q if kind == "dense" else tuple(to_sparse(row) for row in q)
    rows = p if not greedy or rng.random() < 0.5 else logits  # greedy: logits or one-hot p
    return _Session(
        greedy=greedy,
        p=p,
        rows=rows[1:] if kept is not None else rows,
        draft=draft,
        q=q,
        q_sent=q_sent,
        defer=rng.random() < 0.6,
        stored=None if kept is None else kept[1],
        seed=rng.randrange(2**31),
    )


def _run_batch(
    sessions: list[_Session], generators: list[torch.Generator | None]
) -> list[SessionOutcome]:
    return batch_rejection_sample(
        torch.cat([s.rows for s in sessions]),
        torch.cat([s.draft for s in sessions]),
        [s.batch_session(g) for s, g in zip(sessions, generators, strict=True)],
    )


def _single_path(session: _Session, generator: torch.Generator) -> tuple[SessionOutcome, Tensor]:
    """`rejection_sample`, then `Verifier.verify`'s deferral; with the kept p row."""
    tokens, accepted = rejection_sample(session.p, session.draft, session.q, generator)
    k = len(session.draft)
    if session.defer and 0 < k == accepted:  # deferred_row=-1 marks it; the row comes beside
        return SessionOutcome(accepted, tuple(tokens[:k].tolist()), deferred_row=-1), session.p[k]
    return SessionOutcome(accepted, tuple(tokens.tolist())), torch.empty(0)


def _assert_same(batched: SessionOutcome, single: SessionOutcome, kept: Tensor) -> None:
    assert (batched.num_accepted, batched.tokens) == (single.num_accepted, single.tokens)
    assert (batched.deferred_row is None) == (single.deferred_row is None)
    if batched.deferred_row is not None:
        assert torch.equal(_dense(batched.deferred_row, kept.shape[0]), kept.to(torch.float32))


def _deferred_rows(outcome: SessionOutcome, kept: Tensor) -> tuple[Tensor, DeferredRow] | None:
    return None if outcome.deferred_row is None else (kept, outcome.deferred_row)


def test_every_session_matches_rejection_sample_bitwise_over_two_blocks() -> None:
    stored_forms: set[str] = set()
    for seed in range(8):
        rng, gen = random.Random(seed), seeded(seed)
        vocab = rng.choice([7, 16, 40])
        sessions = [_random_session(rng, gen, vocab, None) for _ in range(rng.randint(1, 16))]
        for _ in range(2):
            generators = [seeded(s.seed) for s in sessions]
            singles = [seeded(s.seed) for s in sessions]
            outcomes = _run_batch(sessions, list(generators))
            kept_rows = []
            for index, (session, outcome) in enumerate(zip(sessions, outcomes, strict=True)):
                single, kept = _single_path(session, singles[index])
                _assert_same(outcome, single, kept)
                if not session.greedy:  # same draws, in the same order, from its own generator
                    assert torch.equal(generators[index].get_state(), singles[index].get_state())
                kept_rows.append(_deferred_rows(outcome, kept))
                if session.stored is not None:
                    stored_forms.add(type(session.stored).__name__)
            # Block 2: deferred sessions bring their stored rows, the others start afresh.
            sessions = [_random_session(rng, gen, vocab, kept) for kept in kept_rows]
    # Rows the batch deferred came back in every form and were checked against.
    assert stored_forms == {"int", "SparseDistribution", "Tensor"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_rows_of_other_dtypes_are_compared_in_float32_like_the_single_path(
    dtype: torch.dtype,
) -> None:
    rng, gen = random.Random(21), seeded(21)
    sessions = [
        replace(s, p=s.p.to(dtype), rows=s.rows.to(dtype))
        for s in (_random_session(rng, gen, 16, None) for _ in range(16))
    ]
    generators = [seeded(s.seed) for s in sessions]
    singles = [seeded(s.seed) for s in sessions]
    for session, outcome, single in zip(
        sessions, _run_batch(sessions, list(generators)), singles, strict=True
    ):
        _assert_same(outcome, *_single_path(session, single))
    for session, generator, single in zip(sessions, generators, singles, strict=True):
        if not session.greedy:
            assert torch.equal(generator.get_state(), single.get_state())


def test_stored_rows_of_every_form_and_compact_deferred_rows() -> None:
    # Over many batches, deferral yields all three forms, each exact (checked above) and none
    # a view that would keep the whole batch's rows alive.
    rng, gen = random.Random(77), seeded(77)
    forms: set[str] = set()
    for _ in range(30):
        sessions = [_random_session(rng, gen, 40, None) for _ in range(8)]
        rows = torch.cat([s.rows for s in sessions])
        outcomes = batch_rejection_sample(
            rows,
            torch.cat([s.draft for s in sessions]),
            [s.batch_session(seeded(s.seed)) for s in sessions],
        )
        for session, outcome in zip(sessions, outcomes, strict=True):
            row = outcome.deferred_row
            if row is None:
                continue
            forms.add(type(row).__name__)
            if isinstance(row, Tensor):
                assert row.untyped_storage().data_ptr() != rows.untyped_storage().data_ptr()
                assert int(torch.count_nonzero(row)) * 3 >= row.numel()  # sparse would be bigger
            if isinstance(row, SparseDistribution):
                assert row.token_ids.numel() * 3 < 40
            assert isinstance(row, int) == session.greedy
    assert forms == {"int", "SparseDistribution", "Tensor"}


def _plain(outcomes: list[SessionOutcome], vocab: int) -> list[tuple[object, ...]]:
    """Outcomes as comparable values: a deferred row (a tensor or tensors) as a dense list."""
    return [
        (
            o.num_accepted,
            o.tokens,
            None if o.deferred_row is None else _dense(o.deferred_row, vocab).tolist(),
        )
        for o in outcomes
    ]


def test_a_session_gets_the_same_tokens_alone_in_any_batch_and_on_every_run() -> None:
    rng, gen = random.Random(4), seeded(4)
    sessions = [_random_session(rng, gen, 16, None) for _ in range(12)]
    batched = _plain(_run_batch(sessions, [seeded(s.seed) for s in sessions]), 16)
    assert sum(row is not None for *_, row in batched) >= 3  # deferred rows are compared too
    again = _run_batch(sessions, [seeded(s.seed) for s in sessions])
    assert _plain(again, 16) == batched
    reordered = list(reversed(sessions))
    assert _plain(_run_batch(reordered, [seeded(s.seed) for s in reordered]), 16) == batched[::-1]
    for session, outcome in zip(sessions, batched, strict=True):
        assert _plain(_run_batch([session], [seeded(session.seed)]), 16) == [outcome]


def test_different_seeds_give_different_tokens() -> None:
    rng, gen = random.Random(4), seeded(4)
    session = _random_session(rng, gen, 16, None)
    while session.greedy or len(session.draft) < 2:
        session = _random_session(rng, gen, 16, None)
    outputs = {_run_batch([session], [seeded(seed)])[0].tokens for seed in range(200)}
    assert len(outputs) > 5


# ------------------------------------------------------------------ 3. loop reference


def _loop_reference(
    sessions: list[_Session], generators: list[torch.Generator]
) -> list[tuple[SessionOutcome, Tensor | int]]:
    """The batch's contract one session and one position at a time, on dense p and q: the
    classic rule for greedy sessions (no draws), the reference rule for sampled ones."""
    results: list[tuple[SessionOutcome, Tensor | int]] = []
    for session, generator in zip(sessions, generators, strict=True):
        k, draft = len(session.draft), session.draft.tolist()
        kept: Tensor | int
        if session.greedy:
            argmaxes = [int(row.argmax()) for row in session.p]
            accepted = 0
            while accepted < k and draft[accepted] == argmaxes[accepted]:
                accepted += 1
            tokens = [*draft[:accepted], argmaxes[accepted]]
            kept = argmaxes[k]
        else:
            emitted, accepted = reference_rejection_sample(
                session.p, session.draft, session.q, generator
            )
            tokens, kept = emitted.tolist(), session.p[k]
        if session.defer and 0 < k == accepted:
            results.append((SessionOutcome(accepted, tuple(tokens[:k]), deferred_row=-1), kept))
        else:
            results.append((SessionOutcome(accepted, tuple(tokens)), torch.empty(0)))
    return results


def test_matches_the_loop_reference_exactly() -> None:
    num_rejections = num_deferred = 0
    for seed in range(100, 140):
        rng, gen = random.Random(seed), seeded(seed)
        vocab = rng.randint(2, 24)
        sessions = [_random_session(rng, gen, vocab, None) for _ in range(rng.randint(1, 16))]
        for _ in range(2):
            generators = [seeded(s.seed) for s in sessions]
            references = [seeded(s.seed) for s in sessions]
            outcomes = _run_batch(sessions, list(generators))
            expected = _loop_reference(sessions, references)
            kept_rows = []
            for index, (outcome, (reference, kept)) in enumerate(
                zip(outcomes, expected, strict=True)
            ):
                assert outcome.tokens == reference.tokens, (seed, index)
                assert outcome.num_accepted == reference.num_accepted, (seed, index)
                assert (outcome.deferred_row is None) == (reference.deferred_row is None)
                if outcome.deferred_row is not None:
                    expected_row = _dense(kept, vocab) if isinstance(kept, int) else kept
                    assert torch.equal(_dense(outcome.deferred_row, vocab), expected_row)
                # Greedy sessions draw nothing; sampled ones exactly what the reference draws.
                assert torch.equal(generators[index].get_state(), references[index].get_state())
                num_rejections += outcome.num_accepted < len(sessions[index].draft)
                num_deferred += outcome.deferred_row is not None
                kept_rows.append(
                    None
                    if outcome.deferred_row is None
                    else (_dense(outcome.deferred_row, vocab), outcome.deferred_row)
                )
            sessions = [_random_session(rng, gen, vocab, kept) for kept in kept_rows]
    assert num_rejections > 100 and num_deferred > 50  # both endings were exercised


def test_zero_residual_falls_back_to_the_target_row_as_the_single_path_does() -> None:
    # p <= q everywhere, so max(0, p - q) is all zero; p is scaled down to reach the branch
    # (between distributions only rounding gets there), for dense, sparse and one-hot q.
    target = torch.tensor([[0.4, 0.5, 0.0], [1.0, 0.0, 0.0]])
    dense_q = torch.tensor([[0.5, 0.5, 0.0]])
    cases: list[tuple[Tensor, Tensor, Tensor | tuple[SparseDistribution, ...] | None]] = [
        (target, dense_q, dense_q),
        (target, dense_q, (to_sparse(dense_q[0]),)),
        (torch.tensor([[0.9, 0.0, 0.0], [0.0, 1.0, 0.0]]), _one_hot([0], 3), None),
    ]
    outcomes = set()
    for seed in range(60):
        generators = [seeded(seed + 1000 * index) for index in range(len(cases))]
        batched = batch_rejection_sample(
            torch.cat([p for p, _, _ in cases]),
            token_ids(0, 0, 0),
            [
                BatchSession(1, False, g, sent)
                for g, (_, _, sent) in zip(generators, cases, strict=True)
            ],
        )
        for index, ((p, q, _), outcome) in enumerate(zip(cases, batched, strict=True)):
            single = rejection_sample(p, token_ids(0), q, seeded(seed + 1000 * index))
            assert (outcome.tokens, outcome.num_accepted) == (tuple(single[0].tolist()), single[1])
            outcomes.add((index, outcome.tokens))
    # Rejected, then sampled from p: the rejected token itself comes back.
    assert {(0, (0,)), (1, (0,)), (2, (0,))} <= outcomes
