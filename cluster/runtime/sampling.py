"""Sampling transforms: logits to the distribution a token is actually drawn from.

Contract: pure functions of tensors; no I/O, no global random state. `logits_to_probs` turns
logits into the distribution *actually used* after temperature, top-k and top-p
(`SamplingParams`), as float32 rows that sum to 1; `logits_to_probs_rows` does it for rows that
each have their own settings (an engine step's sessions) in one pass. Tokens are then chosen
from those rows by `cluster.runtime.token_choice` (greedy argmax, or a draw with each row's own
generator). The drafter's q and the verifier's p both come from these, and the rejection rule
in `verifier.rejection` is lossless only because it sees those exact distributions
(docs/architecture.md, invariant 1). A drafter that truncates its distribution sends the
surviving entries as a `SparseDistribution` (`cluster.runtime.sparse_distribution`), whose
`to_dense` rebuilds the exact q from it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.sampling_params import NO_TOP_K, NO_TOP_P, SamplingParams
from cluster.runtime.token_choice import argmax_rows


def _check_logits(logits: Tensor) -> Tensor:  # logits: [n, vocab] -> [n], logits' dtype
    """Return each row's maximum, finite; InvalidArgumentError unless `logits` is a 2-D
    floating-point tensor with a vocabulary, no NaN or +inf, and a finite entry in every row."""
    if not isinstance(logits, Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise InvalidArgumentError(
            "logits must be a 2-D floating-point tensor [n, vocab], got "
            + (
                f"{logits.dtype} {tuple(logits.shape)}"
                if isinstance(logits, Tensor)
                else "non-tensor"
            )
        )
    if logits.shape[1] == 0:
        raise InvalidArgumentError("logits must have a vocabulary of at least one token")
    # One pass over the logits when they are valid (isnan alone costs four times as much): a
    # row's max is NaN if the row holds a NaN (amax propagates it), +inf if it holds +inf,
    # and -inf if every entry is -inf.
    row_max = logits.amax(dim=-1)
    if not bool(torch.isfinite(row_max).all()):
        _raise_for_bad_logits(logits)
    return row_max


def _raise_for_bad_logits(logits: Tensor) -> None:
    """Raise the InvalidArgumentError that says what is wrong with logits known to be bad."""
    if bool(torch.isnan(logits).any()) or bool(torch.isposinf(logits).any()):
        raise InvalidArgumentError("logits must not contain NaN or +inf")
    raise InvalidArgumentError("every logits row needs at least one finite entry")


def logits_to_probs(logits: Tensor, params: SamplingParams) -> Tensor:  # logits: [n, vocab]
    """Return the float32 distribution `[n, vocab]` each row's token is actually drawn from.

    Greedy (temperature 0): exactly one-hot at the argmax; ties go to the lowest index, as with
    `torch.argmax`. Otherwise, in this order: divide by the temperature and softmax in float32;
    top-k keeps exactly `top_k` tokens, the most probable ones, and among tokens tied at the
    boundary the lowest ids survive (a stable sort, so the result never depends on how
    `torch.topk` orders ties on a given device); top-p then keeps, from the renormalised top-k
    distribution, the smallest prefix of most probable tokens whose mass reaches `top_p`
    (always at least the most probable token; ties ordered by id again); finally the kept
    entries are renormalised. Logits may hold -inf (masked tokens) but not NaN or +inf.

    The same as `logits_to_probs_rows(logits, [params] * n)`, which computes it.
    """
    if not isinstance(params, SamplingParams):
        raise InvalidArgumentError(f"params must be a SamplingParams, got {params!r}")
    rows = logits.shape[0] if isinstance(logits, Tensor) and logits.dim() == 2 else 0
    return logits_to_probs_rows(logits, [params] * rows)


def logits_to_probs_rows(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Return the float32 distributions `[n, vocab]` of `n` rows, each under its own params.

    Row `i` follows `params[i]` with exactly the semantics of `logits_to_probs` (one-hot argmax
    when greedy; temperature, top-k, top-p and renormalisation otherwise), in one vectorised
    pass over every row: this is how an engine step turns the logits of many sessions, each
    with its own settings, into their distributions. Rows that share every setting get the
    arithmetic `logits_to_probs` does; a row mixed with other settings can differ from its
    own `logits_to_probs` in the last bits of a sum (a reduction over another shape), so a
    top-p cut can differ only where a cumulative mass lies within that rounding of top_p.
    InvalidArgumentError when `len(params) != n`, or on logits `logits_to_probs` refuses.
    """
    row_max = _check_logits(logits)
    n = logits.shape[0]
    if len(params) != n:
        raise InvalidArgumentError(
            f"logits_to_probs_rows needs one SamplingParams per logits row: {n} rows, "
            f"{len(params)} params"
        )
    if not all(isinstance(row_params, SamplingParams) for row_params in params):
        raise InvalidArgumentError("logits_to_probs_rows takes a SamplingParams for each row")
    vocab = logits.shape[1]
    greedy = [i for i in range(n) if params[i].is_greedy]
    if len(greedy) == n:
        return _one_hot_argmax(logits)
    if not greedy:
        return _sampled_probs(logits, row_max, params, scratch=False)
    # The sampled rows are copied out anyway: ordered by how they are cut, each cut is done in
    # place on a slice of the copy rather than on copied rows of its own.
    sampled = [i for i in range(n) if not params[i].is_greedy]
    sampled.sort(key=lambda i: _cut_kind(params[i], vocab))
    index = torch.tensor(sampled, device=logits.device)
    rows = _sampled_probs(
        logits.index_select(0, index),
        row_max.index_select(0, index),
        [params[i] for i in sampled],
        scratch=True,
    )
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    probs.index_copy_(0, index, rows)
    greedy_index = torch.tensor(greedy, device=logits.device)
    probs[greedy_index, argmax_rows(logits).to(logits.device)[greedy_index]] = 1.0
    return probs


def _one_hot_argmax(logits: Tensor) -> Tensor:  # logits: [n, vocab] -> float32 [n, vocab]
    """Each row one-hot at its argmax, the lowest index on ties (`argmax_rows`)."""
    n, vocab = logits.shape
    one_hot = torch.zeros(n, vocab, dtype=torch.float32, device=logits.device)
    return one_hot.scatter_(1, argmax_rows(logits).to(logits.device)[:, None], 1.0)


_CUT_BY_TOP_K, _CUT_BY_TOP_P_ONLY, _UNCUT = range(3)


def _cut_kind(params: SamplingParams, vocab: int) -> int:
    """How a sampled row is cut: by top-k (then maybe top-p), by top-p alone (a sort of the
    whole vocabulary), or not at all."""
    if NO_TOP_K < params.top_k < vocab:
        return _CUT_BY_TOP_K
    return _CUT_BY_TOP_P_ONLY if params.top_p < NO_TOP_P else _UNCUT


def _sampled_probs(
    logits: Tensor, row_max: Tensor, params: Sequence[SamplingParams], *, scratch: bool
) -> Tensor:
    """Each row's temperature softmax, cut to its top-k and top-p; every row samples.

    `row_max` `[n]` is each row's maximum (`_check_logits`'s). `scratch`: `logits` is this
    call's own copy, which may be overwritten (and returned, if float32). Returns a new tensor.
    """
    logits32 = logits.to(torch.float32)
    temperature = _per_row([p.temperature for p in params], logits.device)
    # Shift before dividing: a tiny temperature would overflow x / T to +inf, and inf - inf is
    # NaN; (x - max) / T is <= 0, and exactly 0 at the max, so exp cannot overflow and the sum
    # is >= 1. The softmax is spelled out because torch.softmax and Tensor.max(dim) hand even
    # a tiny tensor to the CPU thread pool, which stalls for milliseconds on a busy 2-core box.
    # The max of the rounded logits is the rounded max: float32 conversion keeps the order.
    # In place from here on: one buffer, not a new one per operation.
    row_max32 = row_max.to(torch.float32)[:, None]
    own = scratch or logits32 is not logits  # `to` copied them
    shifted = logits32.sub_(row_max32) if own else logits32 - row_max32
    weights = shifted.div_(temperature).exp_()
    probs = weights.div_(weights.sum(dim=-1, keepdim=True))
    return _cut_rows(probs, params)


def _per_row(values: Sequence[float], device: torch.device) -> float | Tensor:
    """`values` as a float32 `[n, 1]` column on `device`, or as the one shared number
    when every row has the same: tensor-by-number arithmetic is what a single-params call
    does (on CUDA, `x / number` multiplies by the reciprocal, where `x / tensor` divides)."""
    first = values[0]
    if all(value == first for value in values):
        return first
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def _cut_rows(probs: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Cut each row of `probs` `[n, vocab]` to its top-k, then its top-p, and renormalise the
    kept entries, in place; rows with no cut are left untouched. Returns `probs`.

    Rows that cut by top-k are cut together, from the candidates of the largest such k; only
    rows with a top-p cut and no top-k cut need their whole vocabulary sorted, so they are
    cut apart from the others. A group of adjacent rows is cut in place, others via a copy.
    """
    n, vocab = probs.shape
    kinds = [_cut_kind(row_params, vocab) for row_params in params]
    for kind in (_CUT_BY_TOP_K, _CUT_BY_TOP_P_ONLY):
        rows = [i for i in range(n) if kinds[i] == kind]
        if not rows:
            continue
        top_ks = [params[i].top_k if kind == _CUT_BY_TOP_K else NO_TOP_K for i in rows]
        top_ps = [params[i].top_p for i in rows]
        if rows[-1] - rows[0] == len(rows) - 1:  # adjacent: a view, cut in place
            _cut(probs[rows[0] : rows[-1] + 1], top_ks, top_ps)
        else:
            index = torch.tensor(rows, device=probs.device)
            probs.index_copy_(0, index, _cut(probs.index_select(0, index), top_ks, top_ps))
    return probs


def _cut(probs: Tensor, top_ks: Sequence[int], top_ps: Sequence[float]) -> Tensor:
    """Cut row `i` of `probs` `[m, vocab]` to its `top_ks[i]` most probable tokens (lowest ids
    first on ties), then to the smallest prefix of those, renormalised, whose mass reaches
    `top_ps[i]`, and renormalise the kept entries; in place, and returns `probs`.

    Contract: every row cuts. Either every `top_ks[i]` is in `(0, vocab)`, or every one is
    `NO_TOP_K` and every row has `top_ps[i] < NO_TOP_P` (then the whole vocabulary is sorted).
    """
    m, vocab = probs.shape
    if top_ks[0] == NO_TOP_K:
        ids = torch.arange(vocab, device=probs.device).expand(m, vocab)
    else:
        # The top-k candidates only: a full-vocabulary sort costs ~30 ms per row on a CPU.
        ids = _top_k_ids(probs, max(top_ks))
    # By probability, most probable first; ties in id order (`ids` ascend, the sort is stable).
    candidates = probs.gather(1, ids)
    sorted_probs, order = candidates.sort(dim=-1, descending=True, stable=True)
    keep_sorted = _ranks_below(top_ks, sorted_probs)
    if any(top_p < NO_TOP_P for top_p in top_ps):
        keep_sorted &= _nucleus(sorted_probs, keep_sorted, top_ps)
    kept_values = torch.where(keep_sorted, sorted_probs, 0.0)
    kept = probs.zero_().scatter_(1, ids.gather(1, order), kept_values)
    return kept.div_(kept.sum(dim=-1, keepdim=True))


def _ranks_below(top_ks: Sequence[int], sorted_probs: Tensor) -> Tensor:  # -> bool [m, width]
    """Which ranks of `sorted_probs` each row's top-k keeps: all of them where every row's k
    is the candidate width (or there is no top-k cut), else the first `top_ks[i]` of row i."""
    m, width = sorted_probs.shape
    if all(top_k in (NO_TOP_K, width) for top_k in top_ks):
        return torch.ones_like(sorted_probs, dtype=torch.bool)
    ks = torch.tensor(top_ks, device=sorted_probs.device)[:, None]
    return torch.arange(width, device=sorted_probs.device).expand(m, width) < ks


def _nucleus(sorted_probs: Tensor, in_top_k: Tensor, top_ps: Sequence[float]) -> Tensor:
    """Which ranks each row's top-p keeps (bool, `sorted_probs`' shape): the smallest prefix
    whose mass, renormalised over the row's top-k (`in_top_k`), reaches the row's top_p."""
    m = sorted_probs.shape[0]
    top_k_probs = torch.where(in_top_k, sorted_probs, 0.0)
    kept = top_k_probs / top_k_probs.sum(dim=-1, keepdim=True)
    mass_before = torch.cat([kept.new_zeros(m, 1), kept.cumsum(dim=-1)[:, :-1]], dim=-1)
    # A row without a top-p cut compares with +inf: a cumulative sum can round past 1.0, and
    # then `< 1.0` would drop its tail. Rank 0 has mass_before 0 < top_p: one token survives.
    limits = [top_p if top_p < NO_TOP_P else math.inf for top_p in top_ps]
    return mass_before < _per_row(limits, sorted_probs.device)


def _top_k_ids(probs: Tensor, top_k: int) -> Tensor:  # probs: [n, vocab] -> [n, top_k]
    """Each row's `top_k` most probable token ids, ascending; at the boundary the lowest ids
    win a tie, whatever order `torch.topk` returns tied values in."""
    n, vocab = probs.shape
    # One more than asked: where the (k+1)-th largest value is below the k-th in every row,
    # no tie crosses the boundary and topk's choice is the only one (a full-vocabulary pass
    # to count the ties would cost more than the topk itself).
    values, ids = probs.topk(min(top_k + 1, vocab), dim=-1)  # largest first
    boundary = values[:, top_k - 1 : top_k]  # the k-th largest value
    if top_k == vocab or bool((values[:, top_k:] < boundary).all()):
        return ids[:, :top_k].sort(dim=-1).values
    above = probs > boundary
    tied = probs == boundary
    room = top_k - above.sum(dim=-1, keepdim=True)  # how many tied tokens fit, >= 1
    keep = above | (tied & (tied.cumsum(dim=-1) <= room))
    return keep.nonzero()[:, 1].view(n, top_k)
