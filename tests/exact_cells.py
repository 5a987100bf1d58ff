"""Pearson's chi-square over cells named by prefixes, for the tests that check sampled output
against the target's exact distribution of its first tokens.

A test builds its cells (`target_cells`, or its own `exact_cells`: the target's probability of
every prefix whose expected count is at least its minimum, `()` holding the rest), then draws
its samples; each sample falls in the cell of its longest prefix among the cells' names.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch
from scipy import stats

from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling import logits_to_probs
from cluster.runtime.sampling_params import SamplingParams

Prefix = tuple[int, ...]


def cell_of(tokens: Prefix, names: Iterable[Prefix]) -> Prefix:
    """The longest prefix of `tokens` among `names` (`()` is always one)."""
    return max((p for p in names if tokens[: len(p)] == p), key=len)


def cell_mass(prefix: Prefix, mass: dict[Prefix, float]) -> float:
    """The mass under `prefix` that no longer name in `mass` takes."""
    children = [p for p in mass if p and p != prefix and cell_of(p[:-1], mass) == prefix]
    return mass[prefix] - sum(mass[p] for p in children)


def chi_square_p_value(
    samples: Sequence[Prefix], cells: dict[Prefix, float], min_expected: float
) -> float:
    """Pearson's p-value of `samples` over `cells` (each cell's exact probability); every
    cell must expect at least `min_expected` samples, for the approximation to hold."""
    counts = Counter(cell_of(tokens, cells) for tokens in samples)
    observed = [counts[cell] for cell in cells]
    expected = [p * len(samples) for p in cells.values()]
    assert min(expected) >= min_expected
    return float(stats.chisquare(observed, expected, sum_check=False).pvalue)


def probabilities(
    model: LoadedModel, contexts: Sequence[Sequence[int]], sampling: SamplingParams
) -> torch.Tensor:
    """`[len(contexts), vocab]` float64: the model's next-token distribution after each
    context (all of one length), as sampled with `sampling`."""
    with torch.inference_mode():
        logits = model.model(torch.tensor(contexts, device=model.device)).logits[:, -1]
        return logits_to_probs(logits, sampling).double().cpu()


def target_cells(
    model: LoadedModel,
    prompt: Prefix,
    sampling: SamplingParams,
    num_tokens: int,
    num_samples: int,
    min_expected: float,
) -> dict[Prefix, float]:
    """Cells of the first `num_tokens` tokens after `prompt` and their exact probabilities
    under `model` sampled with `sampling`, for `num_samples` samples. A cell is named by a
    prefix and holds the samples whose longest prefix among the names it is: a whole
    `num_tokens`-prefix, or the rest under a shorter one, or under `()` everything else. A
    prefix is a name if its expected count is at least `min_expected` and so is its cell's (a
    thin cell joins its parent's); a frequent prefix's parent is frequent, so only frequent
    prefixes are extended, one forward pass per length."""
    mass: dict[Prefix, float] = {(): 1.0}
    level = dict(mass)
    for _ in range(num_tokens):
        if not level:
            break
        parents = list(level)
        probs = probabilities(model, [(*prompt, *p) for p in parents], sampling)
        joint = torch.tensor(list(level.values()), dtype=torch.float64)[:, None] * probs
        frequent = (joint * num_samples >= min_expected).nonzero().tolist()
        level = {(*parents[i], t): float(joint[i, t]) for i, t in frequent}
        mass.update(level)
    for length in range(num_tokens - 1, 0, -1):
        for prefix in [p for p in mass if len(p) == length]:
            if cell_mass(prefix, mass) * num_samples < min_expected:
                del mass[prefix]
    return {prefix: cell_mass(prefix, mass) for prefix in mass}
