"""Drafting the branches of outcome-keyed pre-drafting: the next block for each likely outcome of
a verify pass in flight (`cluster.runtime.predraft`).

A branch is named by the outcome's accept length `a` and the rank of its token among the draft's
choices after the first `a` tokens of the block being verified (rank 0 is its favourite; after a
rejection, a < k, the token the draft proposed there is never the correction, so it is skipped).
Each branch is a task of its own on the replica's engine, over a fork of the session's sequence
(`ModelRunner.fork`: the KV of the committed tokens is copied, not recomputed), so every branch
of every session shares each engine step's forward pass. A branch's first step reads the
draft's odds after its prefix, which names its token; the next `num_tokens` steps draft the block
after it, as the session would draw it (`BranchDraw`, with the handlers of `drafter.draws`).
The fork is released when the branch ends, whatever happens: a branch is soft state, and its
session owes it nothing.

By sampling mode (a branch's block is only ever a proposal: the verifier checks it with the
exact rule the session's own blocks get, so what matters is that it is checked truthfully):

- Greedy: the token is the rank-th of the draft's logits; the block is the draft's argmax at
  each position. The verifier accepts by equality with the target's argmax.
- Seed-exact (`SamplingParams.draws_seed_exact`): the target commits argmax p(x) / E(x), E the
  request's own noise at the position (`cluster.runtime.gumbel`); the draft's guess of it is the
  same race over its own q, so the token is the rank-th of the *noisy* draft scores q(x) / E(x)
  at its position (`noisy_ranked_token`; rank 0 there is the draft's own draw, so after a
  rejection it is the token skipped). The block is drawn seed-exact at the following
  positions: exactly what `Drafter.draft` would draft after the same prefix. The verifier
  accepts by equality with the target's draw, so the output is the seed's whatever is proposed.
- Sampled (rejection rule): the token is a guess, the rank-th of the draft's logits; the block
  is sampled from the draft's q at each position as `Drafter.draft` samples it (the session's
  settings, Saguaro's damping if the drafter applies it), each token's q reported in
  `PreDraft.draft_probs`, with a generator of the branch's own (`BranchDraw.generator`, seeded
  from a draw of the session's generator when the branches are forked, so seeded runs repeat).
  Why this is lossless: whether the verdict hits a branch depends on the verify pass in flight
  (the target, the block being verified and the verifier's randomness) and on the branch's
  token, never on the block drafted after that token, whose randomness is the branch's own.
  So, conditioned on the hit, the block is still a draw from q(. | prefix, token) with that q
  reported, which is all the rejection rule asks of a proposal: the tokens it commits are
  distributed as the target's.

Constrained (structured-output) sessions get no branches: their drafts are masked by the
session's grammar matcher, which stands at the committed tokens and follows one sequence; a
branch would need a matcher of its own. Their rounds pipeline as before.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cluster.runtime.block_runner import ModelRunner
from cluster.runtime.gumbel import exponentials, row_key
from cluster.runtime.kv_cache import SequenceKV
from cluster.runtime.predraft import Branch, PreDraft
from cluster.runtime.sampling import logits_to_probs_rows
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.sparse_distribution import SparseDistribution
from cluster.runtime.task import Batched, Forward, Preempted, Task
from drafter.draws import DraftRow, sample_step, seed_exact_step

_fork_ids = itertools.count()


def fork_id(seq_id: str) -> str:
    """A sequence id for a branch of `seq_id`, never used before in this process."""
    return f"{seq_id}#branch-{next(_fork_ids)}"


@dataclass(frozen=True)
class BranchDraw:
    """How one branch draws its block: as its session would (`sampling`, the session's own),
    with the session's seed for seed-exact noise, or a generator of the branch's own and the
    drafter's Saguaro damping for sampled drafts."""

    sampling: SamplingParams
    seed: int | None = None
    """Seed-exact sessions: the request's seed, which keys the noise."""
    generator: torch.Generator | None = None
    """Sampled sessions: the branch's own generator."""
    saguaro: tuple[float, int] | None = None
    """Sampled sessions: the drafter's Saguaro (scale, top), if it damps its q."""

    @property
    def seed_exact(self) -> bool:
        return self.sampling.draws_seed_exact and self.seed is not None


def ranked_token(logits: torch.Tensor, rank: int, skip: int | None) -> int:
    """The token of `rank` among `logits`' tokens, highest first, `skip` left out."""
    top = torch.topk(logits.float(), min(rank + 2, logits.shape[-1])).indices.tolist()
    ranked = [token for token in top if token != skip]
    return int(ranked[min(rank, len(ranked) - 1)])


def noisy_ranked_token(
    probs: torch.Tensor, seed: int, position: int, rank: int, skip: int | None
) -> int:
    """The token of `rank` among the noisy scores probs(x) / E(seed, position, x) of the tokens
    `probs` (`[vocab]`, a distribution as used) allows, highest first (the lowest id first on
    a tie, as `gumbel_tokens` breaks them), `skip` left out. Rank 0 is `gumbel_tokens`' draw;
    a rank past the tokens allowed gives the last of them."""
    probs32 = probs.to(torch.float32)
    ids = torch.nonzero(probs32 > 0).flatten()  # ascending
    keys = torch.tensor(row_key(seed, position), dtype=torch.int64, device=probs.device)
    scores = probs32[ids].to(torch.float64) / exponentials(ids, keys)
    order = scores.argsort(descending=True, stable=True)
    ranked = [token for token in ids[order].tolist() if token != skip]
    if not ranked:  # only `skip` is allowed: any guess will do, and none can hit
        return int(ids[0])
    return int(ranked[min(rank, len(ranked) - 1)])


def branch_task(
    runner: ModelRunner,
    child_id: str,
    prefix: Sequence[int],
    branch: Branch,
    skip: int | None,
    num_tokens: int,
    draw: BranchDraw | None = None,
) -> Task[PreDraft]:
    """Draft one branch on `child_id` (already forked from the session, holding a prefix of
    `prefix` in its KV): its token after `prefix`, then `num_tokens` more, drawn as `draw` says
    (default: greedily). Releases the fork."""
    draw = draw or BranchDraw(SamplingParams())
    kv = SequenceKV(runner, child_id, prefix)
    try:
        logits = yield from _next_logits(kv)
        token = _branch_token(logits, kv.length, branch, skip, draw)
        drafted: list[int] = []
        probs: list[SparseDistribution] = []
        kv.extend([token])
        for _ in range(num_tokens):
            logits = yield from _next_logits(kv)
            if draw.sampling.is_greedy:
                drafted.append(int(logits[0].argmax()))
            elif draw.seed_exact:
                assert draw.seed is not None
                row = DraftRow(logits, draw.sampling, key=(draw.seed, kv.length))
                drafted.append((yield Batched(seed_exact_step, row)))
            else:
                row = DraftRow(logits, draw.sampling, draw.generator, saguaro=draw.saguaro)
                drafted_token, q = yield Batched(sample_step, row)
                drafted.append(drafted_token)
                probs.append(q)
            kv.extend(drafted[-1:])
        return PreDraft(branch.accepted, token, tuple(drafted), tuple(probs) if probs else None)
    finally:
        kv.release()


def _branch_token(
    logits: torch.Tensor, position: int, branch: Branch, skip: int | None, draw: BranchDraw
) -> int:
    """The branch's token at `position` (the prefix's length), from the draft's logits there."""
    if draw.seed_exact:
        assert draw.seed is not None
        probs = logits_to_probs_rows(logits, [draw.sampling])[0]
        return noisy_ranked_token(probs, draw.seed, position, branch.rank, skip)
    return ranked_token(logits[0], branch.rank, skip)


def _next_logits(kv: SequenceKV) -> Task[torch.Tensor]:
    """The logits after the sequence's last token, running what its KV lacks (again, if the
    engine preempts the fork meanwhile)."""
    while True:
        work = kv.work(1)
        assert work is not None  # one logit row always runs
        try:
            logits: torch.Tensor = yield Forward(work, preemptible=True)
        except Preempted:
            continue
        return logits
