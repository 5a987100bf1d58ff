"""Pearson's chi-square over cells named by prefixes, for the tests that check sampled output
against the target's exact distribution of its first tokens.

A test builds its cells (`exact_cells` in each test: the target's probability of every prefix
whose expected count is at least its minimum, `()` holding the rest), then draws its samples;
each sample falls in the cell of its longest prefix among the cells' names.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from scipy import stats

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
