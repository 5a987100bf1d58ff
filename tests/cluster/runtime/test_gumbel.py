"""Tests for cluster.runtime.gumbel: the seed-exact draw, pure (tensors and ints in and out).

What is checked, and why each check can fail:
- the noise is the documented formula: `row_key` against an independent pure-Python SplitMix64
  (itself checked against the generator's published first output), `exponentials` against the
  formula in Python integers (no int64 to overflow), and its documented bounds
  EXPONENTIAL_MIN..EXPONENTIAL_MAX, both reached (the hash is inverted to find the ids);
- neighbouring (seed, position) keys differ, and their noise rows are uncorrelated;
- `gumbel_tokens` is a function of (row, seed, position) alone: the same token alone, in a
  batch, in any order; and it is the brute-force argmax of p / E over the whole vocabulary, for
  random rows with a huge dynamic range, truncated rows (a zero is never drawn) and rows of a
  real vocabulary's size;
- the CANDIDATE_RATIO pruning never changes the winner, even under the worst-case noise (the
  best token given the largest E, every other the smallest), with rows built at the boundary;
- exact frequencies: over many seeds at a fixed position, and over many positions at a fixed
  seed, a small distribution is drawn with its own probabilities, and two neighbouring
  positions are independent (chi-square). The broken rule of the negative controls
  (`tests.cluster.broken_verifiers.ReusedNoiseVerifier`: every row keyed at position 0) reuses
  one noise row at every position and fails the same test;
- bad inputs raise InvalidArgumentError.

Chi-square bound (as in test_rejection_statistics): the seeds and positions are fixed, so each
test is deterministic; the question is how likely a correct sampler is to fail for this fixed
set. If the hash's outputs behave as independent uniforms (what SplitMix64 and the 32-bit
mixer are built for), each draw is exact to within 2**-32 in probability (the uniform's grid),
far below what 20,000 samples resolve, so the p-value is uniform and falls below ALPHA = 1e-4
with probability 1e-4. Every cell's expected count is at least 400 here, so Pearson's
approximation holds without pooling.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from scipy import stats
from torch import Tensor

from cluster.runtime import gumbel
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.gumbel import (
    CANDIDATE_RATIO,
    EXPONENTIAL_MAX,
    EXPONENTIAL_MIN,
    exponential_row,
    exponentials,
    gumbel_tokens,
    row_key,
)
from cluster.runtime.sampling import logits_to_probs
from cluster.runtime.sampling_params import SamplingParams

ALPHA = 1e-4
NUM_DRAWS = 20_000  # about 0.3 s per 20,000 rows of a tiny vocabulary
SMALL = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04, 0.0, 0.0])  # [8]: two ids excluded
"""A small distribution with zeros; its smallest kept cell expects 800 draws of 20,000."""
QWEN_VOCAB = 151_936

MASK32 = 0xFFFFFFFF
MASK64 = 0xFFFFFFFFFFFFFFFF
MIX32 = 0x045D9F3B


# --- an independent reference of the noise, in Python integers ---------------------------------


def splitmix64(value: int) -> int:
    """SplitMix64's output function (Steele, Lea and Flood 2014) after one state step."""
    z = (value + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def mix32(h: int) -> int:
    h = (((h >> 16) ^ h) * MIX32) & MASK32
    h = (((h >> 16) ^ h) * MIX32) & MASK32
    return (h >> 16) ^ h


def unmix32(h: int) -> int:
    """The inverse of `mix32`: x -> x ^ (x >> 16) undoes itself on 32 bits, and the odd
    multiplier has an inverse modulo 2**32."""
    inverse = pow(MIX32, -1, 2**32)
    h ^= h >> 16
    h = ((h * inverse) & MASK32) ^ (((h * inverse) & MASK32) >> 16)
    h = ((h * inverse) & MASK32) ^ (((h * inverse) & MASK32) >> 16)
    return h


def hashed(token: int, key: tuple[int, int]) -> int:
    """The 32-bit hash of `token` under `key`, as the module docstring defines it."""
    return mix32(mix32(token ^ key[0]) ^ key[1])


def exponential(token: int, key: tuple[int, int]) -> float:
    return -math.log((hashed(token, key) + 0.5) / 2**32)


def brute_force(probs: Tensor, seeds: list[int], positions: list[int]) -> list[int]:
    """argmax over the whole vocabulary of p / E, row by row (float64 of the float32 row)."""
    vocab = probs.shape[1]
    tokens = []
    for row, seed, position in zip(probs, seeds, positions, strict=True):
        ratios = row.to(torch.float32).double() / exponential_row(seed, position, vocab)
        tokens.append(int(ratios.argmax()))
    return tokens


def random_rows(generator: torch.Generator, n: int, vocab: int) -> Tensor:
    """`[n, vocab]` float32 distributions whose probabilities span many decades (logits of
    scale 2..20), so that some tokens sit near the pruning boundary and many far below it."""
    scale = torch.empty(n, 1).uniform_(2.0, 20.0, generator=generator)
    logits = torch.randn(n, vocab, generator=generator) * scale
    return logits.softmax(-1)


def keys_of(n: int, rng: random.Random) -> tuple[list[int], list[int]]:
    seeds = [rng.randrange(2**64) for _ in range(n)]
    positions = [rng.randrange(1 << 20) for _ in range(n)]
    return seeds, positions


# --- the noise ---------------------------------------------------------------------------------


def test_row_key_is_splitmix64_of_the_seed_then_the_position() -> None:
    # The reference itself: SplitMix64 from state 0 first outputs 0xE220A8397B1DCDAF.
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    rng = random.Random(1)
    cases = [(0, 0), (1, 0), (0, 1), (MASK64, MASK64), (2**63, 7)]
    cases += [(rng.randrange(2**64), rng.randrange(2**40)) for _ in range(200)]
    for seed, position in cases:
        key = splitmix64(splitmix64(seed) ^ position)
        assert row_key(seed, position) == (key & MASK32, key >> 32), (seed, position)


def test_neighbouring_seeds_and_positions_get_different_keys() -> None:
    keys = {(s, p): row_key(s, p) for s in range(64) for p in range(64)}
    assert len(set(keys.values())) == len(keys)  # no two of 4,096 neighbours share a key
    assert row_key(1, 0) != row_key(0, 1)  # seed and position are not interchangeable
    # Avalanche: a neighbour's 64-bit key differs in about half its bits (mean of 4,032
    # Binomial(64, 1/2) distances: 32 with a standard deviation of 0.06).
    distances = [
        bin((a0 ^ b0) | (a1 ^ b1) << 32).count("1")
        for (s, p), (a0, a1) in keys.items()
        if p + 1 < 64
        for b0, b1 in [keys[s, p + 1]]
    ]
    assert 31 < sum(distances) / len(distances) < 33


def test_neighbouring_noise_rows_are_uncorrelated() -> None:
    rows = [exponential_row(5, p, QWEN_VOCAB) for p in (100, 101)]  # [vocab] each
    rows.append(exponential_row(6, 100, QWEN_VOCAB))
    for other in rows[1:]:
        # Pearson's r of independent rows: standard deviation 1 / sqrt(151,936) = 0.0026.
        r = torch.corrcoef(torch.stack([rows[0], other]))[0, 1]
        assert abs(float(r)) < 0.02
    # Each row is Exp(1): mean and variance 1 (standard errors 0.0026 and 0.008).
    assert abs(float(rows[0].mean()) - 1) < 0.02
    assert abs(float(rows[0].var()) - 1) < 0.06


def test_exponentials_follow_the_formula_in_python_integers() -> None:
    rng = random.Random(2)
    keys = [row_key(rng.randrange(2**64), rng.randrange(1000)) for _ in range(50)]
    for key in keys:
        ids = [rng.randrange(2**32) for _ in range(20)] + [0, 1, MASK32]
        got = exponentials(torch.tensor(ids), torch.tensor(key))  # [23] float64
        assert got.dtype == torch.float64
        expected = torch.tensor([exponential(t, key) for t in ids], dtype=torch.float64)
        # A wrong 32-bit hash moves E by at least 2**-32 * E / u, far beyond this tolerance.
        torch.testing.assert_close(got, expected, rtol=1e-14, atol=0)


def test_exponential_row_is_exponentials_of_the_row_key() -> None:
    row = exponential_row(123, 45, 300)  # [300]
    key = torch.tensor(row_key(123, 45))
    assert torch.equal(row, exponentials(torch.arange(300), key))
    assert torch.equal(row, exponential_row(123, 45, 300))  # a pure function
    # Keys broadcast: [2, 1, 2] keys against [3] ids give [2, 3].
    keys = torch.tensor([[row_key(1, 2)], [row_key(3, 4)]])
    both = exponentials(torch.tensor([0, 7, 9]), keys)
    assert both.shape == (2, 3)
    assert torch.equal(both[1], exponential_row(3, 4, 10)[[0, 7, 9]])


def test_exponentials_reach_their_documented_bounds_and_never_pass_them() -> None:
    key = row_key(99, 3)
    # The ids whose hash is 0 (u smallest, E largest) and 2**32 - 1 (E smallest).
    largest = unmix32(unmix32(0) ^ key[1]) ^ key[0]
    smallest = unmix32(unmix32(MASK32) ^ key[1]) ^ key[0]
    assert hashed(largest, key) == 0 and hashed(smallest, key) == MASK32
    extremes = exponentials(torch.tensor([largest, smallest]), torch.tensor(key))
    assert float(extremes[0]) == pytest.approx(EXPONENTIAL_MAX, rel=1e-15)
    assert float(extremes[1]) == pytest.approx(EXPONENTIAL_MIN, rel=1e-12)
    # And a million other draws stay inside.
    values = exponentials(torch.arange(1 << 20), torch.tensor(key))
    assert float(values.min()) >= EXPONENTIAL_MIN and float(values.max()) <= EXPONENTIAL_MAX


# --- the draw ----------------------------------------------------------------------------------


def test_a_row_draws_the_same_token_alone_in_a_batch_and_in_any_order() -> None:
    generator = torch.Generator().manual_seed(3)
    probs = random_rows(generator, 24, 257)  # [24, 257]
    probs[::3] = logits_to_probs(probs[::3].log(), SamplingParams(temperature=1.0, top_p=0.7))
    seeds, positions = keys_of(24, random.Random(3))
    together = gumbel_tokens(probs, seeds, positions)
    assert together == gumbel_tokens(probs.clone(), list(seeds), list(positions))  # repeatable
    alone = [gumbel_tokens(probs[i : i + 1], [seeds[i]], [positions[i]])[0] for i in range(24)]
    assert together == alone
    order = torch.randperm(24, generator=generator).tolist()
    shuffled = gumbel_tokens(probs[order], [seeds[i] for i in order], [positions[i] for i in order])
    assert shuffled == [together[i] for i in order]
    # Among rows of another vocabulary spread (one-hot and uniform neighbours) as well.
    mixed = torch.cat([torch.full((2, 257), 1 / 257), probs[:5], torch.eye(257)[:3]])
    tokens = gumbel_tokens(mixed, [1, 2, *seeds[:5], 3, 4, 5], [0, 0, *positions[:5], 0, 0, 0])
    assert tokens[2:7] == together[:5] and tokens[7:] == [0, 1, 2]


def test_the_draw_is_the_brute_force_argmax_over_the_whole_vocabulary() -> None:
    generator = torch.Generator().manual_seed(4)
    rng = random.Random(4)
    rows = random_rows(generator, 400, 257)  # [400, 257]
    truncations = [
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.7, top_p=0.6),
        SamplingParams(temperature=1.3, top_k=40, top_p=0.9),
    ]
    truncated = torch.cat([logits_to_probs(rows[:100].log(), p) for p in truncations])  # [300]
    uniform_and_one_hot = torch.cat([torch.full((20, 257), 1 / 257), torch.eye(257)[:20]])
    probs = torch.cat([rows, truncated, uniform_and_one_hot])  # [740, 257]
    seeds, positions = keys_of(probs.shape[0], rng)
    tokens = gumbel_tokens(probs, seeds, positions)
    assert tokens == brute_force(probs, seeds, positions)
    chosen = probs[torch.arange(len(tokens)), torch.tensor(tokens)]
    assert bool((chosen > 0).all())  # a zero is never drawn
    assert tokens[-20:] == list(range(20))  # a one-hot row draws its token whatever the noise
    # Uniform rows under different seeds: the noise alone picks their tokens.
    assert len(set(tokens[700:720])) > 10


def test_the_draw_is_the_brute_force_argmax_at_a_real_vocabulary_size() -> None:
    generator = torch.Generator().manual_seed(5)
    probs = random_rows(generator, 6, QWEN_VOCAB)  # [6, 151936]
    probs[3] = logits_to_probs(probs[3:4].log(), SamplingParams(temperature=1.0, top_p=0.9))[0]
    seeds, positions = [0, 1, 2, 2**64 - 1, 7, 7], [0, 0, 5, 5, 6, 6 + 1]
    assert gumbel_tokens(probs, seeds, positions) == brute_force(probs, seeds, positions)


def _worst_case_exponentials(token_ids: Tensor, keys: Tensor) -> Tensor:
    """Noise as unkind to the pruning as the bounds allow: token 0, the best of each test row,
    gets the largest exponential (its ratio smallest), every other token the smallest."""
    largest = torch.tensor(EXPONENTIAL_MAX, dtype=torch.float64)
    smallest = torch.tensor(EXPONENTIAL_MIN, dtype=torch.float64)
    return torch.where(token_ids == 0, largest, smallest)


def test_candidate_pruning_never_changes_the_winner_even_under_the_worst_noise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With token 0 at probability `best` and E(0) = EXPONENTIAL_MAX, a token x wins exactly
    when p(x) / EXPONENTIAL_MIN > best / EXPONENTIAL_MAX, i.e. p(x) > best * bound. Rows put
    one token just above that bound (it must be a candidate, and win) or just below the
    pruning threshold (pruned, and it must lose), over a vocabulary of far smaller tokens."""
    bound = EXPONENTIAL_MIN / EXPONENTIAL_MAX
    assert bound > CANDIDATE_RATIO  # the threshold keeps every token that could win
    margins = [1e-2, 1e-4, 3e-7, -1e-4, -2e-6, -1e-2]  # above the bound, then below the ratio
    rows = []
    for best in (1.0, 0.5, 0.125, 0.01):
        for margin in margins:
            row = torch.full((64,), best * bound * 1e-3)  # filler: far below the boundary
            row[0] = best
            row[5] = best * (bound if margin > 0 else CANDIDATE_RATIO) * (1 + margin)
            rows.append(row)
    probs = torch.stack(rows).to(torch.float32)  # [24, 64]: unnormalised, as allowed
    n = probs.shape[0]
    monkeypatch.setattr(gumbel, "exponentials", _worst_case_exponentials)
    tokens = gumbel_tokens(probs, [0] * n, [0] * n)
    brute = [int((row.double() / _worst_case_exponentials(torch.arange(64), row)).argmax())
             for row in probs]  # fmt: skip
    assert tokens == brute
    assert tokens == [5 if margin > 0 else 0 for _ in range(4) for margin in margins]


# --- exact frequencies -------------------------------------------------------------------------


def chi_square_p(counts: Tensor, probs: Tensor) -> float:
    """Pearson's p-value of `counts` against `probs` (same shape) over the allowed cells; a
    draw of an excluded cell is a hard failure."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    assert float(counts[probs == 0].sum()) == 0, "drew a token of probability 0"
    observed, expected = counts[probs > 0], probs[probs > 0] / probs.sum() * counts.sum()
    assert float(expected.min()) >= 5  # Pearson's approximation needs no pooling here
    return float(stats.chisquare(observed.numpy(), expected.numpy()).pvalue)


def frequencies(tokens: list[int], vocab: int) -> Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double()


def test_draws_over_seeds_at_a_fixed_position_follow_the_distribution() -> None:
    probs = SMALL.expand(NUM_DRAWS, -1)  # [20000, 8]
    tokens = gumbel_tokens(probs, list(range(NUM_DRAWS)), [17] * NUM_DRAWS)
    assert chi_square_p(frequencies(tokens, 8), SMALL) > ALPHA


def test_draws_over_positions_at_a_fixed_seed_follow_the_distribution() -> None:
    probs = SMALL.expand(NUM_DRAWS, -1)
    positions = list(range(NUM_DRAWS))
    tokens = gumbel_tokens(probs, [2**64 - 5] * NUM_DRAWS, positions)
    assert chi_square_p(frequencies(tokens, 8), SMALL) > ALPHA
    # Negative control: the broken rule reuses one noise row at every position, so a seed
    # draws one token forever, and the same test rejects it.
    reused = gumbel_tokens(probs, [2**64 - 5] * NUM_DRAWS, [0] * NUM_DRAWS)
    assert len(set(reused)) == 1
    assert chi_square_p(frequencies(reused, 8), SMALL) < ALPHA


@pytest.mark.parametrize("noise_positions", [True, False], ids=["keyed", "reused-noise"])
def test_neighbouring_positions_are_independent(noise_positions: bool) -> None:
    """Over seeds, the pair (token at position 40, token at 41) follows p x p: the two
    positions' noises are independent. The broken rule (both keyed at position 0) correlates
    them completely (the same row draws the same token twice) and must fail."""
    half = NUM_DRAWS // 2
    seeds = list(range(half))
    probs = SMALL[:6].expand(2 * half, -1)  # [20000, 6]: the allowed ids, 36 cells, min 16
    positions = [40] * half + [41] * half if noise_positions else [0] * (2 * half)
    tokens = gumbel_tokens(probs, seeds + seeds, positions)
    pairs = torch.tensor(tokens[:half]) * 6 + torch.tensor(tokens[half:])
    counts = torch.bincount(pairs, minlength=36).double()
    joint = (SMALL[:6, None] * SMALL[None, :6]).flatten()
    passes = chi_square_p(counts, joint) > ALPHA
    assert passes == noise_positions


# --- bad inputs --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("probs", "seeds", "positions", "match"),
    [
        (torch.ones(4), [0], [0], "2-D"),
        (torch.ones(1, 2, 4), [0], [0], "2-D"),
        ([[0.5, 0.5]], [0], [0], "2-D"),
        (torch.ones(2, 4), [0], [0, 1], "a seed and a position per row"),
        (torch.ones(2, 4), [0, 1], [0], "a seed and a position per row"),
        (torch.zeros(1, 4), [0], [0], "positive, finite"),
        (torch.tensor([[0.5, 0.5], [0.0, 0.0]]), [0, 1], [0, 0], "positive, finite"),
        (torch.tensor([[0.5, math.nan]]), [0], [0], "positive, finite"),
        (torch.tensor([[0.5, math.inf]]), [0], [0], "positive, finite"),
        (torch.tensor([[-1.0, -2.0]]), [0], [0], "positive, finite"),
        (torch.ones(1, 4), [-1], [0], "seed"),
        (torch.ones(1, 4), [2**64], [0], "seed"),
        (torch.ones(1, 4), [0], [-1], "position"),
    ],
    ids=["1-d", "3-d", "list", "seeds", "positions", "zero-row", "one-zero-row", "nan",
         "inf", "negative", "seed-negative", "seed-too-big", "position-negative"],
)  # fmt: skip
def test_bad_inputs_raise_invalid_argument(
    probs: object, seeds: list[int], positions: list[int], match: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        gumbel_tokens(probs, seeds, positions)  # type: ignore[arg-type]


def test_row_key_refuses_values_out_of_range() -> None:
    for seed, position in [(-1, 0), (2**64, 0), (0, -1), (0, 2**64)]:
        with pytest.raises(InvalidArgumentError):
            row_key(seed, position)
    assert row_key(2**64 - 1, 2**64 - 1)  # the largest values are keys


def test_no_rows_draw_nothing() -> None:
    assert gumbel_tokens(torch.empty(0, 8), [], []) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_device_draws_the_same_tokens_as_the_cpu() -> None:
    generator = torch.Generator().manual_seed(7)
    probs = random_rows(generator, 64, QWEN_VOCAB)  # [64, 151936]
    seeds, positions = keys_of(64, random.Random(7))
    assert gumbel_tokens(probs.cuda(), seeds, positions) == gumbel_tokens(probs, seeds, positions)
