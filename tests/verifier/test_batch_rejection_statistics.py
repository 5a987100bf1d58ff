"""Statistics for verifier.batch_rejection: the tokens a batch emits follow the target
(Pearson's chi-square), the fourth kind of test in docs/architecture.md, "Tests"; the cases and
the statistic are test_rejection_statistics.py's."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from cluster.runtime.sparse_distribution import SparseDistribution, to_sparse
from tests.verifier.rejection_reference import seeded
from tests.verifier.test_rejection_statistics import (
    ALPHA,
    NUM_TRIALS,
    STAT_CASES,
    _case_distributions,
    _chi_square_p_value,
)
from verifier.batch_rejection import BatchSession, batch_rejection_sample

_REPLICAS = 10  # sessions per case in one call; divides NUM_TRIALS


def test_emitted_tokens_of_a_batch_are_distributed_as_the_target() -> None:
    """Each session of a batch emits (t1, t2, t3) distributed as p_1 x p_2 x p_3.

    The cases and the statistic are test_rejection_statistics.py's: k = 2 rounds, a fresh
    sample from p standing in for positions after an early stop or a deferred bonus (the rows
    do not depend on earlier tokens), Pearson's test over the pooled vocab**3 cells. Here the
    rounds run batched, five sessions a call: dense, sparse and one-hot q, and a session whose
    position 1 is a stored row (sparse) with its own bonus deferred when both tokens pass.

    Why the bound is safe: every session draws from its own generator only (the batch never
    shares one, checked in `verifier.batch_inputs.check_layout`) and its drafts come from a
    separate generator, so a session's trials are independent draws and, under a correct
    sampler, its p-value is uniform: it falls below ALPHA = 1e-4 with probability 1e-4, so
    5e-4 for the five. The seeds are fixed, so the test is deterministic: it passes on every
    run or, with those odds, on none. Its power is that of test_rejection_statistics.py (same
    trials, same cells), whose negative controls show the statistic catching a wrong residual
    and an off-by-one bonus.
    """
    cases = {case.name: _case_distributions(case) for case in STAT_CASES}
    layout = [  # (case, how q is sent, position 1 from a stored row)
        ("temperature", "dense", False),
        ("top-k", "sparse", False),
        ("top-p", "dense", False),
        ("deterministic-draft", "one-hot", False),
        ("top-k", "sparse", True),
    ]
    draws = seeded(98)
    rows, sessions, drafts, emitted = [], [], [], []
    for name, sent, stored in layout:
        target, fixed_draft, draft_probs = cases[name]
        q_sent: Tensor | tuple[SparseDistribution, ...] | None = None
        if draft_probs is None:
            drafts.append(fixed_draft.expand(NUM_TRIALS, 2))
        else:
            q_sent = draft_probs if sent == "dense" else tuple(map(to_sparse, draft_probs))
            drafts.append(
                torch.multinomial(draft_probs, NUM_TRIALS, replacement=True, generator=draws).T
            )
        rows.append(target[1:] if stored else target)
        sessions.append(
            BatchSession(
                num_draft=2,
                greedy=False,
                draft_probs=q_sent,
                defer_bonus=stored,
                stored_row=to_sparse(target[0]) if stored else None,
                generator=torch.Generator(),  # replaced per replica below
            )
        )
        fresh = torch.multinomial(target, NUM_TRIALS, replacement=True, generator=draws).T
        emitted.append(fresh.clone())  # [NUM_TRIALS, 3]
    # REPLICAS copies of each session per call, each with its own generator: a call runs
    # REPLICAS trials of every case, so NUM_TRIALS trials take NUM_TRIALS / REPLICAS calls.
    batch = [
        replace(session, generator=seeded(1000 * replica + index))
        for replica in range(_REPLICAS)
        for index, session in enumerate(sessions)
    ]
    target_rows = torch.cat(rows * _REPLICAS)
    # Trial t of a case is replica t % REPLICAS of call t // REPLICAS.
    all_drafts = torch.cat(drafts, dim=1).reshape(NUM_TRIALS // _REPLICAS, -1)
    for call in range(NUM_TRIALS // _REPLICAS):
        outcomes = batch_rejection_sample(target_rows, all_drafts[call], batch)
        for position, outcome in enumerate(outcomes):
            replica, index = divmod(position, len(sessions))
            trial = call * _REPLICAS + replica
            emitted[index][trial, : len(outcome.tokens)] = torch.tensor(outcome.tokens)
    for (name, _, _), tokens in zip(layout, emitted, strict=True):
        assert _chi_square_p_value(tokens, cases[name][0]) >= ALPHA, name
