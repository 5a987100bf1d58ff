"""Outcome-keyed pre-drafting on the drafter (`Drafter.predraft`, `drafter.branches`): each
branch is the draft model's own choice after its outcome's prefix, then the block the session
would draft after it (greedy, seed-exact or sampled, Saguaro-damped where configured), all
drafted at once over forks of the session; the session itself is left at its committed tokens."""

from __future__ import annotations

import pytest
import torch

from cluster.runtime.gumbel import gumbel_tokens
from cluster.runtime.models import LoadedModel
from cluster.runtime.predraft import Branch, PreDraft
from cluster.runtime.saguaro import saguaro_probs
from cluster.runtime.sampling import logits_to_probs
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.sparse_distribution import to_dense
from drafter.branches import noisy_ranked_token, ranked_token
from drafter.config import DrafterConfig
from drafter.drafter import Drafter, draft_sampling
from tests.drafter.test_drafter import GREEDY, PROMPT, greedy_continuation

SEED_EXACT = SamplingParams(temperature=1.0, seed_exact=True)
SAMPLED = SamplingParams(temperature=1.0)
BLOCK = (70, 71, 72)
"""The block being verified while the branches are drafted."""


def _ranked(model: LoadedModel, tokens: list[int], rank: int, skip: int | None) -> int:
    with torch.inference_mode():
        logits = model.model(torch.tensor([tokens])).logits[0, -1]
    return ranked_token(logits, rank, skip)


def test_each_branch_is_the_draft_models_choice_then_its_greedy_block(
    tiny_draft: LoadedModel,
) -> None:
    drafter = Drafter(tiny_draft)
    drafter.open_session("s", PROMPT, GREEDY, seed=0)
    block = drafter.draft("s", len(PROMPT), (), 4).tokens
    # The round before was all accepted, then 66: the drafter catches up as it drafts.
    branches = [Branch(a, rank) for a in range(4) for rank in (0, 1)]  # of the 3-token block
    drafts = drafter.predraft("s", len(PROMPT), (*block, 66), (70, 71, 72), branches, 3)
    assert [(d.accepted) for d in drafts] == [b.accepted for b in branches]
    committed = [*PROMPT, *block, 66]
    for branch, draft in zip(branches, drafts, strict=True):
        prefix = committed + [70, 71, 72][: branch.accepted]
        skip = (70, 71, 72)[branch.accepted] if branch.accepted < 3 else None
        assert draft.token == _ranked(tiny_draft, prefix, branch.rank, skip), branch
        assert draft.token != skip
        assert list(draft.tokens) == greedy_continuation(tiny_draft, [*prefix, draft.token], 3)
    # The session stands at its committed tokens, and drafts on from there as before.
    after = drafter.draft("s", len(committed), (), 2)
    assert list(after.tokens) == greedy_continuation(tiny_draft, committed, 2)
    assert drafter.stats().num_sessions == 1
    # Every fork was released: the pool holds the session's sequence alone.
    assert drafter._runner.sequences() == (drafter._sessions.get("s").kv.seq_id,)


def _draft_probs(model: LoadedModel, tokens: list[int], sampling: SamplingParams) -> torch.Tensor:
    """The draft's q `[vocab]` after `tokens`, as a drafter with the default top_k samples it."""
    with torch.inference_mode():
        logits = model.model(torch.tensor([tokens])).logits[:, -1]
    return logits_to_probs(logits, draft_sampling(sampling, DrafterConfig().top_k))[0]


def _predrafted(
    drafter: Drafter, sampling: SamplingParams, seed: int, branches: list[Branch]
) -> tuple[list[int], list[PreDraft]]:
    """The committed tokens (a first block all accepted, then 66) and the branches of BLOCK."""
    drafter.open_session("s", PROMPT, sampling, seed=seed)
    first = drafter.draft("s", len(PROMPT), (), 2).tokens
    drafts = drafter.predraft("s", len(PROMPT), (*first, 66), BLOCK, branches, 3)
    assert [d.accepted for d in drafts] == [b.accepted for b in branches]
    return [*PROMPT, *first, 66], drafts


def test_a_seed_exact_branch_is_what_the_drafter_would_draft_after_it(
    tiny_draft: LoadedModel,
) -> None:
    """Its token is the rank-th of the draft's noisy scores at its position, and its block the
    seed-exact draft after it: what `Drafter.draft` itself drafts from that prefix."""
    seed = 11
    drafter = Drafter(tiny_draft)
    branches = [Branch(a, rank) for a in range(4) for rank in (0, 1)]
    committed, drafts = _predrafted(drafter, SEED_EXACT, seed, branches)
    sampling = draft_sampling(SEED_EXACT, drafter.config.top_k)
    for i, (branch, draft) in enumerate(zip(branches, drafts, strict=True)):
        prefix = committed + list(BLOCK[: branch.accepted])
        skip = BLOCK[branch.accepted] if branch.accepted < 3 else None
        q = _draft_probs(tiny_draft, prefix, SEED_EXACT)
        assert draft.token == noisy_ranked_token(q, seed, len(prefix), branch.rank, skip)
        assert draft.token != skip
        if branch.rank == 0 and skip is None:  # the draft's own seed-exact draw there
            assert [draft.token] == gumbel_tokens(q[None], [seed], [len(prefix)])
        assert draft.draft_probs is None
        # The drafter, asked to draft after the same prefix and token, drafts the same block.
        drafter.open_session(f"ref-{i}", committed, sampling, seed=seed)
        appended = (*BLOCK[: branch.accepted], draft.token)
        reference = drafter.draft(f"ref-{i}", len(committed), appended, 3)
        assert draft.tokens == reference.tokens, branch
    # Rank 1 after a rejection is not rank 0's token: the ranks name different outcomes.
    assert all(drafts[2 * a].token != drafts[2 * a + 1].token for a in range(4))
    assert drafter.stats().num_sessions == 1 + len(branches)


def test_noisy_ranks_order_the_tokens_by_their_noisy_scores(tiny_draft: LoadedModel) -> None:
    q = _draft_probs(tiny_draft, list(PROMPT), SEED_EXACT)
    ranked = [noisy_ranked_token(q, 5, 14, rank, None) for rank in range(6)]
    assert ranked[0] == gumbel_tokens(q[None], [5], [14])[0]
    assert len(set(ranked)) == 6 and all(q[t] > 0 for t in ranked)
    # Skipping a token moves every later rank up by one.
    assert [noisy_ranked_token(q, 5, 14, rank, ranked[0]) for rank in range(5)] == ranked[1:]
    # Other noise (another position) ranks them otherwise.
    assert [noisy_ranked_token(q, 5, 15, rank, None) for rank in range(6)] != ranked


@pytest.mark.parametrize("saguaro", [None, (0.3, 2)], ids=["q", "saguaro"])
def test_a_sampled_branch_is_drawn_from_the_q_it_reports(
    tiny_draft: LoadedModel, saguaro: tuple[float, int] | None
) -> None:
    """Its token is the rank-th of the draft's logits (a guess); its block is sampled, and each
    token comes with the exact q it was drawn from: the draft's after that prefix, damped as
    the drafter's Saguaro setting says."""
    scale, top = saguaro if saguaro is not None else (None, 4)
    drafter = Drafter(tiny_draft, DrafterConfig(saguaro_scale=scale, saguaro_top=top))
    branches = [Branch(a, rank) for a in range(4) for rank in (0, 1)]
    committed, drafts = _predrafted(drafter, SAMPLED, 3, branches)
    for branch, draft in zip(branches, drafts, strict=True):
        prefix = committed + list(BLOCK[: branch.accepted])
        skip = BLOCK[branch.accepted] if branch.accepted < 3 else None
        assert draft.token == _ranked(tiny_draft, prefix, branch.rank, skip)
        assert draft.draft_probs is not None and len(draft.draft_probs) == len(draft.tokens) == 3
        context = [*prefix, draft.token]
        for token, sparse in zip(draft.tokens, draft.draft_probs, strict=True):
            q = _draft_probs(tiny_draft, context, SAMPLED)
            if saguaro is not None:
                q = saguaro_probs(q[None], *saguaro)[0]
            reported = to_dense([sparse], tiny_draft.vocab_size)[0]
            torch.testing.assert_close(reported, q, atol=1e-5, rtol=1e-4)
            assert reported[token] > 0
            context.append(token)
    # Each branch has randomness of its own: the blocks are not all one draw.
    assert len({d.tokens for d in drafts}) > 1


def test_sampled_branches_repeat_for_a_seed(tiny_draft: LoadedModel) -> None:
    """Each branch's generator is seeded from the session's: the same seed drafts the same
    branches, and the session draws on after them as it would again."""

    def run(seed: int) -> tuple[list[PreDraft], tuple[int, ...]]:
        drafter = Drafter(tiny_draft)
        committed, drafts = _predrafted(drafter, SAMPLED, seed, [Branch(0, 0), Branch(3, 0)])
        return drafts, drafter.draft("s", len(committed), (), 4).tokens

    def tokens(drafts: list[PreDraft]) -> list[tuple[int, ...]]:
        return [d.tokens for d in drafts]

    (first, after), (again, after_again), (other, _) = run(3), run(3), run(4)
    assert tokens(first) == tokens(again) and after == after_again
    assert tokens(first) != tokens(other)


def test_saguaro_drafts_report_the_damped_q(tiny_draft: LoadedModel) -> None:
    """`Drafter.draft`'s sampled path draws from q' and sends q', not q."""
    drafter = Drafter(tiny_draft, DrafterConfig(saguaro_scale=0.5, saguaro_top=3))
    drafter.open_session("s", PROMPT, SAMPLED, seed=2)
    block = drafter.draft("s", len(PROMPT), (), 3)
    assert block.draft_probs is not None
    context = list(PROMPT)
    for token, sparse in zip(block.tokens, block.draft_probs, strict=True):
        q = _draft_probs(tiny_draft, context, SAMPLED)
        expected = saguaro_probs(q[None], 0.5, 3)[0]
        reported = to_dense([sparse], tiny_draft.vocab_size)[0]
        torch.testing.assert_close(reported, expected, atol=1e-5, rtol=1e-4)
        assert not torch.allclose(reported, q, atol=1e-3)  # damped indeed
        context.append(token)
