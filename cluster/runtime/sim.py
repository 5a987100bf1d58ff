"""The simulated device: what a forward pass costs on a modelled GPU, and the logits it returns.

Tandem is built for GPUs, where a verify pass takes milliseconds; on a CPU a real pass takes
hundreds and hides the system's own cost. A simulated model stands in for the forward pass only:
everything around it (router, wire, engine, KV blocks, sampling, acceptance) runs for real. This
module is the pure part, no model object and no waiting:

- `DeviceProfile` (`cluster.runtime.sim_source`, with the source string): modelled seconds of
  one pass, `base_s + per_token_s x tokens in the step + per_context_s x tokens attended`
  (tokens attended: the KV length every sequence of the step reads, its context after the
  step). Named profiles (`PROFILES`) carry their sources.
- `SimSource` (`cluster.runtime.sim_source`): a model source string
  `sim://ROLE/PROFILE?alpha=A&vocab=V&seed=S` parsed once, torch-free, so that a config naming
  one is checked without loading torch.
- `sim_logits`: the logits of a causal LM whose next-token distribution is a function of the
  last two tokens and the position alone, from a seeded table: deterministic in any process,
  and a proper causal LM (the same context gives the same row). The draft's rows are the
  target's, except that at a seeded share 1 - alpha of positions its favourite token is
  another one: its greedy agreement with the target is alpha. Its host cost is counted as the
  system's own, so it is kept small: the contexts are hashed over numpy arrays (in plain
  integers for a few rows), then one gather of background rows and a write of each row's picks.
- `ideal_rates`: the analytic tokens/s a perfect system would reach with those costs, for
  serial, pipelined and outcome-keyed pre-drafted rounds (`cluster.runtime.predraft`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from cluster.runtime import predraft
from cluster.runtime.limits import MAX_PREDRAFT_FAN_OUT
from cluster.runtime.sim_source import END_OF_TEXT_ID, FAVOURED, FIRST_WORD_ID, DeviceProfile

# Re-exported: `cluster.runtime.models` reads a simulated source through this module.
from cluster.runtime.sim_source import SIM_SCHEME as SIM_SCHEME
from cluster.runtime.sim_source import SimSource as SimSource

NUM_TAIL_ROWS = 16
"""Rows of seeded background logits; the favoured tokens vary over the whole vocabulary."""
TAIL_SHIFT = -8.0
END_OF_TEXT_LOGIT = -40.0
"""Texts never end by themselves (benchmarks run to max_tokens); the id stays a valid token."""
DRAFT_SALT = 0x5DEECE66D
DRAFT_LOGIT = FAVOURED[0] + 1.0
"""Where the draft disagrees, its word's logit: above every favoured token."""
_MASK_62 = (1 << 62) - 1
_UNIFORM_STEPS = 1 << 24
_ROW_STAGGER = 64
"""Floats between one background row's end and the next one's start: the 16 rows then sit 256
bytes apart within a 4 KiB page. Copying a row to an output 16 bytes past it (mod 4 KiB) is ~7x
slower (4K aliasing in memmove); at vocab 4,096 every row of an unstaggered table sits so when a
step's rows land on the heap right after it (~400 us for 64 rows instead of ~55, measured on a
2-core AMD EPYC). Staggered, one row in 16 at most does."""
VECTOR_MIN_ROWS = 20
"""From this many rows on the keys are hashed over numpy arrays: ~100 array operations of
~1.5 us each (~130 for a draft) whatever the rows, against ~9 us a row (~11) in plain integers
(measured on a 2-core AMD EPYC, numpy 2.4)."""

Hashes = TypeVar("Hashes", int, npt.NDArray[np.integer[Any]])
"""A hash or a uint64 array of them: the same arithmetic serves both, with the same values
(uint64 arithmetic wraps modulo 2^64, and every step keeps the low 62 bits, which wrapping
leaves exact)."""


def tail_table(vocab_size: int, seed: int) -> npt.NDArray[np.float32]:
    """float32 [NUM_TAIL_ROWS, vocab]: the seeded background logits, each row `_ROW_STAGGER`
    floats past the end of the one before."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.randn(NUM_TAIL_ROWS, vocab_size, generator=generator) + TAIL_SHIFT
    table[:, END_OF_TEXT_ID] = END_OF_TEXT_LOGIT
    staggered = np.empty((NUM_TAIL_ROWS, vocab_size + _ROW_STAGGER), np.float32)[:, :vocab_size]
    staggered[...] = table.numpy()
    return staggered


def _mix(x: Hashes) -> Hashes:
    """A 62-bit integer hash (splitmix64's finaliser, kept non-negative)."""
    x = x & _MASK_62
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B) & _MASK_62
    x = ((x ^ (x >> 27)) * 0x94D049BB133111E) & _MASK_62
    return x ^ (x >> 31)


def context_hash(seed: int, previous: Hashes, current: Hashes, position: Hashes) -> Hashes:
    """The key of (seed, token before, token, position); previous is -1 at position 0 (as
    uint64, 2^64 - 1: adding 2 wraps to the same 1)."""
    x = _mix(position * 0x9E3779B97F4A7C1 + (seed & _MASK_62))
    x = _mix(x ^ ((previous + 2) * 0x632BE59BD9B4E01))
    return _mix(x ^ ((current + 1) * 0x2545F4914F6CDD1))


def _picks(key: Hashes, words: int, alpha: float | None) -> list[Hashes]:
    """What a row's key chooses: its background row, its favoured tokens in `FAVOURED`'s
    order, and for a draft (`alpha` below 1) the word it would put above them and its draw
    (it does where `draw / _UNIFORM_STEPS >= alpha`)."""
    picks = [key % NUM_TAIL_ROWS]
    chained = key
    for _ in FAVOURED:
        chained = _mix(chained + 1)
        picks.append(FIRST_WORD_ID + chained % words)
    if alpha is not None and alpha < 1.0:
        draw = _mix(key ^ DRAFT_SALT)
        offset = 1 + _mix(draw) % (words - 1)  # never the target's favourite itself
        picks.append(FIRST_WORD_ID + (picks[1] - FIRST_WORD_ID + offset) % words)
        picks.append(draw % _UNIFORM_STEPS)
    return picks


def sim_logits(
    table: npt.NDArray[np.float32],  # [NUM_TAIL_ROWS, vocab]: `tail_table`
    seed: int,
    previous: Sequence[int],  # [n]
    current: Sequence[int],  # [n]
    positions: Sequence[int],  # [n]: the position of `current`
    alpha: float | None = None,
) -> Tensor:
    """float32 [n, vocab] (a fresh CPU tensor): next-token logits after `current` at each
    position; a target's rows when `alpha` is None, else its draft's.

    One gather of background rows, then the favoured tokens written lowest first, so that
    where two of a row's picks are the same id the higher one's logit stands, and the
    draft's word last, above them all. The first favoured token is the target's argmax: the
    background lies 12 standard deviations below it.
    """
    words = table.shape[1] - FIRST_WORD_ID
    if len(current) < VECTOR_MIN_ROWS:
        picks = [
            _picks(context_hash(seed, *c), words, alpha)
            for c in zip(previous, current, positions, strict=True)
        ]
        rows = table[[p[0] for p in picks]]  # a copy
        for row, (_, *tokens) in zip(rows, picks, strict=True):
            for i in reversed(range(len(FAVOURED))):
                row[tokens[i]] = FAVOURED[i]
            if alpha is not None and len(tokens) > len(FAVOURED):
                other, draw = tokens[len(FAVOURED) :]
                if draw / _UNIFORM_STEPS >= alpha:
                    row[other] = DRAFT_LOGIT
        return torch.from_numpy(rows)
    keys = context_hash(
        seed,
        np.asarray(previous, dtype=np.int64).view(np.uint64),  # -1 as 2^64 - 1
        np.asarray(current, dtype=np.uint64),
        np.asarray(positions, dtype=np.uint64),
    )
    columns = _picks(keys, words, alpha)
    rows = table[columns[0]]
    flat = rows.reshape(-1)
    starts = np.arange(len(keys), dtype=np.uint64) * rows.shape[1]
    for i in reversed(range(len(FAVOURED))):
        flat[starts + columns[1 + i]] = FAVOURED[i]
    if alpha is not None and len(columns) > 1 + len(FAVOURED):
        others, draws = columns[1 + len(FAVOURED) :]
        flat[(starts + others)[draws / _UNIFORM_STEPS >= alpha]] = DRAFT_LOGIT
    return torch.from_numpy(rows)


# --------------------------------------------------------------------------------------------- #
# What a perfect system would reach with these costs


@dataclass(frozen=True)
class IdealRates:
    """Tokens/s an ideal system would reach: no time but the modelled device's."""

    target_only: float
    serial: float
    pipelined: float
    tokens_per_verify: float
    verify_s: float
    draft_block_s: float
    predrafted: float = 0.0
    """Outcome-keyed pre-drafting at its best fan-out (`predraft_fan_out`)."""
    predraft_fan_out: int = 0
    predraft_hit: float = 0.0
    """The share of rounds whose outcome was pre-drafted, at that fan-out."""


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a k-token block commits per verify pass at per-token acceptance alpha."""
    if k == 0:
        return 1.0
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def ideal_rates(
    target: DeviceProfile,
    draft: DeviceProfile,
    alpha: float,
    k: int,
    streams: int = 1,
    context_tokens: int = 256,
    max_fan_out: int = MAX_PREDRAFT_FAN_OUT,
) -> IdealRates:
    """Aggregate tokens/s for `streams` streams of mean context `context_tokens`, each drafting
    `k` tokens a round at acceptance `alpha`.

    Serial rounds: draft k tokens (k draft passes at batch `streams`), then one verify pass of
    `streams x (k + 1)` tokens. Pipelined rounds: on a hit (all k accepted, probability
    alpha^k) the next block was drafted during the verify pass, so the round takes the longer
    of the two and commits k tokens (the bonus is deferred into the next block); on a miss the
    round takes both in turn and commits the accepted tokens and the correction.
    Pre-drafted rounds (`_predrafted`): the best fan-out up to `max_fan_out`.
    """
    attended = streams * context_tokens
    decode_s = target.step_s(streams, attended)
    verify_s = target.step_s(streams * (k + 1), attended)
    draft_block_s = k * draft.step_s(streams, attended)
    per_verify = expected_tokens(alpha, k)
    serial = streams * per_verify / (draft_block_s + verify_s) if k else streams / decode_s
    hit = alpha**k if k else 0.0
    miss_tokens = per_verify - hit * (k + 1)  # the expected tokens of miss rounds
    pipelined_s = hit * max(verify_s, draft_block_s) + (1 - hit) * (draft_block_s + verify_s)
    pipelined = streams * (hit * k + miss_tokens) / pipelined_s if k else serial
    predrafted, fan_out, hit_share = 0.0, 0, 0.0
    for f in range(1, max_fan_out + 1) if k else ():
        rate, share = _predrafted(target, draft, alpha, k, streams, context_tokens, f)
        if rate > predrafted:
            predrafted, fan_out, hit_share = rate, f, share
    return IdealRates(
        target_only=streams / decode_s,
        serial=serial,
        pipelined=pipelined,
        tokens_per_verify=per_verify,
        verify_s=verify_s,
        draft_block_s=draft_block_s,
        predrafted=predrafted,
        predraft_fan_out=fan_out,
        predraft_hit=hit_share,
    )


def sim_predraft_hit(alpha: float, k: int, fan_out: int) -> float:
    """The share of verify passes whose outcome is among the `fan_out` pre-drafted for, with
    the simulated draft's odds (greedy): where it disagrees with the target (a share
    1 - alpha of positions) the target's favourite is its second choice, so a correction is
    always its best remaining guess, and the bonus token is its first choice with probability
    alpha and its second otherwise."""
    block = list(range(k))  # any k distinct ids: the draft's own first choices
    second = [k + a for a in range(k + 1)]
    odds = [[(block[a], alpha), (second[a], 1.0 - alpha)] for a in range(k)]
    odds.append([(k + 2 * k + 1, alpha), (second[k], 1.0 - alpha)])
    return predraft.hit_rate(predraft.likely_outcomes(block, odds, alpha, fan_out))


def _predrafted(
    target: DeviceProfile,
    draft: DeviceProfile,
    alpha: float,
    k: int,
    streams: int,
    context_tokens: int,
    fan_out: int,
) -> tuple[float, float]:
    """Tokens/s and hit share of outcome-keyed pre-drafting at `fan_out`: during each verify
    pass the drafter drafts `fan_out` k-token blocks for every stream as one batch (k + 1
    passes of `streams x fan_out` rows, each reading its own context: a branch's token after a
    whole block is the draft's guess after the block's last token, which no pass has read yet,
    so a round's chain is that token's pass and k more). A hit round takes the longer of the
    two and commits every token of the verdict, the bonus included; a miss then drafts its next
    block as a serial round does."""
    attended = streams * context_tokens
    verify_s = target.step_s(streams * (k + 1), attended)
    draft_block_s = k * draft.step_s(streams, attended)
    predraft_s = (k + 1) * draft.step_s(streams * fan_out, attended * fan_out)
    hit = sim_predraft_hit(alpha, k, fan_out)
    round_s = max(verify_s, predraft_s) + (1.0 - hit) * draft_block_s
    return streams * expected_tokens(alpha, k) / round_s, hit
