"""The simulated device: what a forward pass costs on a modelled GPU, and the logits it returns.

Tandem is built for GPUs, where a verify pass takes milliseconds; on a CPU a real pass takes
hundreds and hides the system's own cost. A simulated model stands in for the forward pass only:
everything around it (router, wire, engine, KV blocks, sampling, acceptance) runs for real. This
module is the pure part, no model object and no waiting:

- `DeviceProfile`: modelled seconds of one pass, `base_s + per_token_s x tokens in the step +
  per_context_s x tokens attended` (tokens attended: the KV length every sequence of the step
  reads, its context after the step). Named profiles (`PROFILES`) carry their sources.
- `SimSource`: a model source string `sim://ROLE/PROFILE?alpha=A&vocab=V&seed=S` parsed once.
- `sim_logits`: the logits of a causal LM whose next-token distribution is a function of the
  last two tokens and the position alone, from a seeded table: cheap (a gather and a scatter),
  deterministic in any process, and a proper causal LM (the same context gives the same row).
  The draft's rows are the target's, except that at a seeded share 1 - alpha of positions
  its favourite token is another one: its greedy agreement with the target is alpha.
- `ideal_rates`: the analytic tokens/s a perfect system would reach with those costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

import torch
from torch import Tensor

SIM_SCHEME = "sim://"
ROLES = ("target", "draft")
DEFAULT_VOCAB_SIZE = 32_000
DEFAULT_ALPHA = 0.8
DEFAULT_SEED = 0
NUM_BYTES = 256
END_OF_TEXT_ID = NUM_BYTES
"""Ids 0..255 are bytes (prompts encode to them), 256 ends a text, the rest are words."""
FIRST_WORD_ID = NUM_BYTES + 1
NUM_TAIL_ROWS = 16
"""Rows of seeded background logits; the favoured tokens vary over the whole vocabulary."""
TAIL_SHIFT = -8.0
FAVOURED = (4.0, 3.0, 2.0)
"""Logits of a row's three favoured tokens over a N(-8, 1) background: at a vocabulary of
32,000 the first holds about 0.55 of the mass, as a peaked language model's top token does."""
END_OF_TEXT_LOGIT = -40.0
"""Texts never end by themselves (benchmarks run to max_tokens); the id stays a valid token."""
DRAFT_SALT = 0x5DEECE66D
_MASK_62 = (1 << 62) - 1
_UNIFORM_STEPS = 1 << 24


@dataclass(frozen=True)
class DeviceProfile:
    """Modelled time of one forward pass. The figures are parameters with cited sources, not
    claims about Tandem on a GPU."""

    base_s: float
    per_token_s: float
    per_context_s: float
    source: str = ""

    def step_s(self, tokens: int, attended: int) -> float:
        """Seconds for a pass over `tokens` new tokens whose sequences read `attended` KV
        entries in all."""
        return self.base_s + self.per_token_s * tokens + self.per_context_s * attended


PROFILES: dict[str, DeviceProfile] = {
    # Llama-3.1-8B, bf16, one H100 SXM: 158 tokens/s at batch 1 without speculation (SGLang's
    # published decode benchmark), 6.3 ms a step. Growth with batched tokens: weights (16 GB)
    # are read once a pass, so decode stays near memory-bound; ~0.03 ms a token is the
    # compute cost of 16 GFLOP a token at ~550 dense bf16 TFLOP/s achieved, matching published
    # vLLM/SGLang decode curves that reach ~8 ms a step at batch 64. Attention reads 128 KiB
    # of bf16 K/V a token (32 layers x 8 KV heads x 128 x 2 x 2 bytes) at ~3.35 TB/s.
    "h100-8b": DeviceProfile(
        base_s=6.3e-3,
        per_token_s=3.0e-5,
        per_context_s=4.0e-8,
        source="SGLang Llama-3.1-8B H100 decode 158 tok/s; H100 SXM 3.35 TB/s",
    ),
    # Qwen2.5-0.5B, bf16, one A10G (600 GB/s): ~1 GB of weights a pass plus launch overhead,
    # about 1.5 ms a token at batch 1; 12 KiB of K/V a token.
    "a10g-0.5b": DeviceProfile(
        base_s=1.5e-3,
        per_token_s=1.0e-5,
        per_context_s=2.0e-8,
        source="A10G 600 GB/s; ~1 GB bf16 weights of a 0.5B model per pass",
    ),
    # No modelled time at all: every millisecond measured is the system's own.
    "instant": DeviceProfile(0.0, 0.0, 0.0, source="none: measures the system alone"),
}


@dataclass(frozen=True)
class SimSource:
    """A parsed `sim://ROLE/PROFILE?alpha=A&vocab=V&seed=S` source."""

    role: str
    profile_name: str
    alpha: float = DEFAULT_ALPHA
    """The draft's greedy agreement with the target (ignored for a target)."""
    vocab_size: int = DEFAULT_VOCAB_SIZE
    seed: int = DEFAULT_SEED
    """The target's function; a draft names its target's seed."""

    @property
    def profile(self) -> DeviceProfile:
        return PROFILES[self.profile_name]

    @classmethod
    def parse(cls, source: str) -> SimSource:
        """Parse and validate; `ValueError` says what is wrong."""
        if not source.startswith(SIM_SCHEME):
            raise ValueError(f"a simulated model's source starts with {SIM_SCHEME}")
        parts = urlsplit(source)
        role, profile = parts.netloc, parts.path.strip("/")
        if role not in ROLES:
            raise ValueError(f"{source!r}: the role must be one of {', '.join(ROLES)}")
        if profile not in PROFILES:
            raise ValueError(
                f"{source!r}: unknown device profile {profile!r}; known: {', '.join(PROFILES)}"
            )
        options = dict(parse_qsl(parts.query, strict_parsing=bool(parts.query)))
        unknown = set(options) - {"alpha", "vocab", "seed"}
        if unknown:
            raise ValueError(f"{source!r}: unknown options {', '.join(sorted(unknown))}")
        try:
            alpha = float(options.get("alpha", DEFAULT_ALPHA))
            vocab = int(options.get("vocab", DEFAULT_VOCAB_SIZE))
            seed = int(options.get("seed", DEFAULT_SEED))
        except ValueError:
            raise ValueError(
                f"{source!r}: alpha is a number, vocab and seed whole numbers"
            ) from None
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"{source!r}: alpha must be in [0, 1], got {alpha}")
        if vocab < FIRST_WORD_ID + len(FAVOURED):
            raise ValueError(f"{source!r}: vocab must be >= {FIRST_WORD_ID + len(FAVOURED)}")
        return cls(role, profile, alpha, vocab, seed)


def tail_table(vocab_size: int, seed: int) -> Tensor:
    """float32 [NUM_TAIL_ROWS, vocab]: the seeded background logits."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.randn(NUM_TAIL_ROWS, vocab_size, generator=generator) + TAIL_SHIFT
    table[:, END_OF_TEXT_ID] = END_OF_TEXT_LOGIT
    return table


def _mix(x: int) -> int:
    """A 62-bit integer hash (splitmix64's finaliser, kept non-negative)."""
    x &= _MASK_62
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B) & _MASK_62
    x = ((x ^ (x >> 27)) * 0x94D049BB133111E) & _MASK_62
    return x ^ (x >> 31)


def context_hash(seed: int, previous: int, current: int, position: int) -> int:
    """The key of (seed, token before, token, position); previous is -1 at position 0."""
    x = _mix(position * 0x9E3779B97F4A7C1 + seed)
    x = _mix(x ^ ((previous + 2) * 0x632BE59BD9B4E01))
    return _mix(x ^ ((current + 1) * 0x2545F4914F6CDD1))


def sim_logits(
    table: Tensor,  # [NUM_TAIL_ROWS, vocab]
    seed: int,
    previous: Sequence[int],  # [n]
    current: Sequence[int],  # [n]
    positions: Sequence[int],  # [n]: the position of `current`
    alpha: float | None = None,
) -> Tensor:
    """float32 [n, vocab]: next-token logits after `current` at each position; a target's rows
    when `alpha` is None, else its draft's.

    The keys are hashed in plain integers (a step asks for a few rows; a handful of tensor
    operations each would cost more than the hashing), then one gather and one scatter build
    the rows. The first favoured token is the target's argmax: the
    background lies 12 standard deviations below it.
    """
    vocab = table.shape[1]
    words = vocab - FIRST_WORD_ID
    keys = [context_hash(seed, *c) for c in zip(previous, current, positions, strict=True)]
    rows = table.index_select(
        0, torch.tensor([k % NUM_TAIL_ROWS for k in keys], dtype=torch.long)
    )  # a copy
    favoured: dict[int, float] = {}  # flat index in rows -> logit; the higher rank wins an id
    top: list[int] = []
    for i, key in enumerate(keys):
        for rank, value in enumerate(FAVOURED):
            key = _mix(key + 1)
            token = FIRST_WORD_ID + key % words
            favoured.setdefault(i * vocab + token, value)
            if rank == 0:
                top.append(token)
    if alpha is not None and alpha < 1.0:
        # The draft puts another word above the target's favourite at a seeded share of rows.
        for i, key in enumerate(keys):
            draw = _mix(key ^ DRAFT_SALT)
            if (draw % _UNIFORM_STEPS) / _UNIFORM_STEPS >= alpha:
                offset = 1 + _mix(draw) % (words - 1)  # never the target's favourite itself
                other = FIRST_WORD_ID + (top[i] - FIRST_WORD_ID + offset) % words
                favoured[i * vocab + other] = FAVOURED[0] + 1.0
    if favoured:
        flat = rows.view(-1)
        flat[torch.tensor(list(favoured), dtype=torch.long)] = torch.tensor(
            list(favoured.values()), dtype=rows.dtype
        )
    return rows


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
) -> IdealRates:
    """Aggregate tokens/s for `streams` streams of mean context `context_tokens`, each drafting
    `k` tokens a round at acceptance `alpha`.

    Serial rounds: draft k tokens (k draft passes at batch `streams`), then one verify pass of
    `streams x (k + 1)` tokens. Pipelined rounds: on a hit (all k accepted, probability
    alpha^k) the next block was drafted during the verify pass, so the round takes the longer
    of the two and commits k tokens (the bonus is deferred into the next block); on a miss the
    round takes both in turn and commits the accepted tokens and the correction.
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
    return IdealRates(
        target_only=streams / decode_s,
        serial=serial,
        pipelined=pipelined,
        tokens_per_verify=per_verify,
        verify_s=verify_s,
        draft_block_s=draft_block_s,
    )
