"""Outcome-keyed pre-drafting on the drafter (`Drafter.predraft`, `drafter.branches`): each
branch is the draft model's own choice after its outcome's prefix, then its greedy block, all
drafted at once over forks of the session; the session itself is left at its committed tokens."""

from __future__ import annotations

import torch

from cluster.runtime.models import LoadedModel
from cluster.runtime.predraft import Branch
from cluster.runtime.sampling import SamplingParams
from drafter.branches import ranked_token
from drafter.drafter import Drafter
from tests.drafter.test_drafter import GREEDY, PROMPT, greedy_continuation


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


def test_sampled_sessions_get_no_branches(tiny_draft: LoadedModel) -> None:
    drafter = Drafter(tiny_draft)
    drafter.open_session("s", PROMPT, SamplingParams(temperature=1.0), seed=3)
    block = drafter.draft("s", len(PROMPT), (), 2)
    assert drafter.predraft("s", len(PROMPT), (), block.tokens, [Branch(0, 0)], 2) == []
