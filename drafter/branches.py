"""Drafting the branches of outcome-keyed pre-drafting: the next block for each likely outcome of
a verify pass in flight (`cluster.runtime.predraft`).

A branch is named by the outcome's accept length `a` and the rank of its token among the draft's
own choices after the first `a` tokens of the block being verified (rank 0 is its favourite;
after a rejection, a < k, the token the draft proposed there is never the correction, so it is
skipped). Each branch is a task of its own on the replica's engine, over a fork of the session's
sequence (`ModelRunner.fork`: the KV of the committed tokens is copied, not recomputed), so every
branch of every session shares each engine step's forward pass. A branch's first step reads the
draft's odds after its prefix, which names its token; the next `num_tokens` steps draft the block
after it, greedily. The fork is released when the branch ends, whatever happens: a branch is
soft state, and its session owes it nothing.

Greedy sessions only: a sampled draft's block must be drawn from the distribution it reports (a
branch would need the session's own generator), and a seed-exact guess ranks the target's noisy
draw, not the draft's favourites; both are left to plain pipelining.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from cluster.runtime.engine import Forward, Preempted, Task
from cluster.runtime.kv_cache import SequenceKV
from cluster.runtime.predraft import Branch, PreDraft
from cluster.runtime.runner import ModelRunner

_fork_ids = itertools.count()


def fork_id(seq_id: str) -> str:
    """A sequence id for a branch of `seq_id`, never used before in this process."""
    return f"{seq_id}#branch-{next(_fork_ids)}"


def ranked_token(logits: torch.Tensor, rank: int, skip: int | None) -> int:
    """The token of `rank` among `logits`' tokens, highest first, `skip` left out."""
    top = torch.topk(logits.float(), min(rank + 2, logits.shape[-1])).indices.tolist()
    ranked = [token for token in top if token != skip]
    return int(ranked[min(rank, len(ranked) - 1)])


def branch_task(
    runner: ModelRunner,
    child_id: str,
    prefix: Sequence[int],
    branch: Branch,
    skip: int | None,
    num_tokens: int,
) -> Task[PreDraft]:
    """Draft one branch on `child_id` (already forked from the session, holding a prefix of
    `prefix` in its KV): its token after `prefix`, then `num_tokens` more. Releases the fork."""
    kv = SequenceKV(runner, child_id, prefix)
    try:
        logits = yield from _next_logits(kv)
        token = ranked_token(logits[0], branch.rank, skip)
        drafted: list[int] = []
        kv.extend([token])
        for _ in range(num_tokens):
            logits = yield from _next_logits(kv)
            drafted.append(int(logits[0].argmax()))
            kv.extend(drafted[-1:])
        return PreDraft(branch.accepted, token, tuple(drafted))
    finally:
        kv.release()


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
