"""The statistical audit: do a service's unseeded samples follow the plain target's distribution?

Contract: `first_two_test(target, prompt, sampling, samples)` takes the target model, a prompt,
the request's sampling settings and the first two tokens of N sampled outputs of that prompt,
and returns Pearson's chi-square test of the observed (t1, t2) pairs against the target's exact
joint distribution P(t1, t2) = p(t1 | prompt) * p(t2 | prompt, t1), with p the distribution
actually sampled (`sampling.logits_to_probs`: temperature, top-k, top-p). A rejection-rule
request's tokens depend on its draw order, so they can only be checked this way; a seed-exact
one can be too, but the token-by-token audit (`cluster.runtime.audit`) says more.

Why the probabilities are exact: p(t1) comes from one plain forward pass over the prompt, and
p(t2 | t1) from one plain forward pass over prompt + t1 for each distinct t1 observed, batch of
one, in float64 from there on; nothing is estimated. A first token that ends the sequence has
no second: its cell is (t1, END) with probability p(t1).

Why the cells are sound: the test's cells are every (t1, t2) with t1 observed and an expected
count N * P(t1, t2) of at least `MIN_EXPECTED` (t2 observed or not: the whole row p(t2 | t1)
is known), then one pooled cell for the rest of the mass (merged into the smallest other cell
if its own expectation is below MIN_EXPECTED). A pair with expected count >= 5 needs
N * p(t1) >= 5, and then t1 is observed with probability >= 1 - e^-5, so the cells are, but
for that small chance, the fixed set {P >= 5 / N}: chosen before looking at the counts, as the
chi-square test requires, with the usual rule of at least 5 expected per cell for its
approximation. Under a correct service the p-value is then (asymptotically) uniform, and it
falls below alpha with probability alpha. A sample the target cannot produce (p = 0 after
top-k / top-p) is no statistical matter: the p-value is 0.

When it is not sound: the reference must compute the service's p. A service in bf16 against a
float32 reference differs by rounding (about 1e-2 relative on a probability), which enough
samples will detect: keep N modest (a few thousand), or replay in the service's dtype.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from scipy import stats
from torch import Tensor

from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling import logits_to_probs
from cluster.runtime.sampling_params import SamplingParams

MIN_EXPECTED = 5.0
"""The smallest expected count a cell may have on its own (the chi-square rule of thumb)."""

END = -1
"""The second token of a sample whose first token ended the sequence."""

Cell = tuple[int, int]
"""(t1, t2); t2 is `END` when t1 ended the sequence."""


@dataclass(frozen=True)
class StatisticalAudit:
    """The chi-square test of N samples' first two tokens against the target's P(t1, t2)."""

    p_value: float
    statistic: float
    degrees_of_freedom: int
    cells: tuple[Cell | None, ...]
    """Each cell of the test; None is the pooled rest (absent when the rest's expected count
    is too small for a cell: it is then added to the smallest cell, which keeps its name)."""
    observed: tuple[int, ...]
    """Samples in each cell."""
    expected: tuple[float, ...]
    """N * P of each cell."""
    num_samples: int
    impossible: int
    """Samples the target cannot produce (P = 0): any makes the p-value 0."""

    def passed(self, alpha: float) -> bool:
        """True when the samples are consistent with the target at level `alpha`."""
        return self.p_value >= alpha


def first_two_test(
    target: LoadedModel,
    prompt_tokens: Sequence[int],
    sampling: SamplingParams,
    samples: Sequence[Sequence[int]],
) -> StatisticalAudit:
    """Test `samples` (each the first two generated tokens, or one when it ended the sequence)
    against the plain target's joint distribution; see the module docstring."""
    if sampling.is_greedy:
        raise InvalidArgumentError(
            "a greedy request has no distribution to test: audit it token by token"
        )
    prompt = [int(t) for t in prompt_tokens]
    if not prompt:
        raise InvalidArgumentError("the statistical audit needs a prompt of at least one token")
    if not samples:
        raise InvalidArgumentError("the statistical audit needs at least one sample")
    eos = target.eos_token_ids
    pairs = [_cell(i, sample, eos) for i, sample in enumerate(samples)]
    first = _next_probs(target, prompt, sampling)  # [vocab] float64
    rows = {t1: _next_probs(target, [*prompt, t1], sampling) for t1 in {t1 for t1, _ in pairs}}
    return _chi_square(Counter(pairs), first, rows, eos)


def _cell(index: int, sample: Sequence[int], eos: frozenset[int]) -> Cell:
    tokens = [int(t) for t in sample]
    if len(tokens) >= 2:
        return tokens[0], tokens[1]
    if len(tokens) == 1 and tokens[0] in eos:
        return tokens[0], END
    raise InvalidArgumentError(
        f"sample {index} has {len(tokens)} tokens: each needs two, or one that ends the sequence"
    )


def _next_probs(target: LoadedModel, tokens: list[int], sampling: SamplingParams) -> Tensor:
    """The distribution sampled for the token after `tokens`: float64 `[vocab]`."""
    vocab = target.vocab_size
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidArgumentError(
            f"token id {bad} is outside the target's vocabulary 0..{vocab - 1}"
        )
    model: Any = target.model  # transformers' call signature is opaque to type checkers
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([tokens], device=target.device)).logits[0, -1:]
        return logits_to_probs(logits.float(), sampling)[0].double().cpu()


def _chi_square(
    counts: Counter[Cell], first: Tensor, rows: dict[int, Tensor], eos: frozenset[int]
) -> StatisticalAudit:
    """The test over the module docstring's cells. `first`: p(t1) `[vocab]`; `rows[t1]`:
    p(t2 | t1) `[vocab]` for every observed t1."""
    n = sum(counts.values())
    impossible = sum(c for cell, c in counts.items() if _probability(cell, first, rows, eos) <= 0)
    cells: list[Cell | None] = []
    expected: list[float] = []
    for t1, row in sorted(rows.items()):
        p1 = float(first[t1])
        if t1 in eos:
            candidates = [((t1, END), p1)]
        else:
            joint = row * p1  # [vocab]: P(t1, t2) for every t2
            big = (joint * n >= MIN_EXPECTED).nonzero().flatten().tolist()
            candidates = [((t1, t2), float(joint[t2])) for t2 in big]
        for cell, probability in candidates:
            if probability * n >= MIN_EXPECTED:
                cells.append(cell)
                expected.append(probability * n)
    observed = [counts.get(cell, 0) for cell in cells if cell is not None]  # every cell
    rest_expected = max(n - sum(expected), 0.0)
    rest_observed = n - sum(observed)
    if rest_expected >= MIN_EXPECTED or not cells:
        cells.append(None)
        expected.append(rest_expected)
        observed.append(rest_observed)
    else:  # too little mass left for a cell of its own: into the smallest cell
        smallest = min(range(len(cells)), key=expected.__getitem__)
        expected[smallest] += rest_expected
        observed[smallest] += rest_observed
    statistic = sum(
        (o - e) ** 2 / e if e > 0 else (math.inf if o else 0.0)
        for o, e in zip(observed, expected, strict=True)
    )
    df = len(cells) - 1
    if impossible:
        p_value = 0.0
    elif df == 0:
        p_value = 1.0  # one cell: every sample is in it, as expected
    else:
        p_value = float(stats.chi2.sf(statistic, df))
    return StatisticalAudit(
        p_value=p_value,
        statistic=float(statistic),
        degrees_of_freedom=df,
        cells=tuple(cells),
        observed=tuple(observed),
        expected=tuple(expected),
        num_samples=n,
        impossible=impossible,
    )


def _probability(cell: Cell, first: Tensor, rows: dict[int, Tensor], eos: frozenset[int]) -> float:
    t1, t2 = cell
    if t2 == END:
        return float(first[t1]) if t1 in eos else 0.0
    return 0.0 if t1 in eos else float(first[t1] * rows[t1][t2])
