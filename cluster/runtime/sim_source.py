"""A simulated model's source: `sim://ROLE/PROFILE?alpha=A&vocab=V&seed=S`, parsed once
(`SimSource`), the device profile it names (`DeviceProfile`, `PROFILES`) and the layout of its
vocabulary.

Plain data, validated when parsed, no I/O and no torch: a `ModelSpec` naming a simulated model
(`cluster.runtime.model_spec`) is checked here when a config is read, without loading anything.
The model itself (its logits and timing) is `cluster.runtime.sim` and `cluster.runtime.sim_model`.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

SIM_SCHEME = "sim://"
ROLES = ("target", "draft")
DEFAULT_VOCAB_SIZE = 32_000
DEFAULT_ALPHA = 0.8
DEFAULT_SEED = 0
# The simulated vocabulary's layout (`cluster.runtime.sim.sim_logits` draws from it): a source's
# vocab must hold the bytes, the end of text and room for a row's favoured words.
NUM_BYTES = 256
END_OF_TEXT_ID = NUM_BYTES
"""Ids 0..255 are bytes (prompts encode to them), 256 ends a text, the rest are words."""
FIRST_WORD_ID = NUM_BYTES + 1
FAVOURED = (4.0, 3.0, 2.0)
"""Logits of a row's three favoured tokens over a N(-8, 1) background: at a vocabulary of
32,000 the first holds about 0.55 of the mass, as a peaked language model's top token does
(about 0.65 at 4,096, where the background holds less)."""


@dataclass(frozen=True)
class DeviceProfile:
    """Modelled time of one forward pass. The figures are parameters with cited sources, not
    claims about Tandem on a GPU."""

    base_s: float
    per_token_s: float
    per_context_s: float
    source: str = ""
    max_step_tokens: int = 2048
    max_step_sequences: int = 256
    """What one pass on such a device carries at most by default (a replica's config may set
    its own): a GPU engine's batch budget (vLLM's default max_num_batched_tokens is 2,048 for
    online serving and max_num_seqs 256), not a CPU's."""

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
    # Llama-3.1-70B, FP8 weights and FP8 KV cache, one H200 SXM (4.8 TB/s, 1,979 dense FP8
    # TFLOP/s): estimates from the hardware's figures, not a measurement. The weights (70.6
    # GB) are read once a pass: 14.7 ms at the peak bandwidth, ~16 ms at the ~90% of it
    # decode reaches, launches included (CUDA graphs). A token costs 141 GFLOP: 0.13 ms at
    # ~1,100 TFLOP/s achieved (about half the peak, as `h100-8b` assumes of bf16). Attention
    # reads 160 KiB of FP8 K/V a token (80 layers x 8 KV heads x 128 x 2 x 1 byte; twice that
    # in bf16) at 4.8 TB/s. For comparison, NVIDIA's NIM benchmarks publish an ITL of 18.6-18.9
    # ms for Llama-3.3-70B FP8 at concurrency 1 on two H100s (TP2, all-reduces included).
    "h200-70b": DeviceProfile(
        base_s=16.0e-3,
        per_token_s=1.3e-4,
        per_context_s=3.4e-8,
        source="estimate: 70.6 GB FP8 weights at H200 4.8 TB/s; 141 GFLOP a token",
    ),
    # Llama-3.2-1B (the 70B's tokenizer), bf16, one H100 SXM: 2.5 GB of weights a pass, 0.74
    # ms at 3.35 TB/s, plus launch overhead for its 16 layers (half the 8B's 1.5 ms beyond its
    # weight reads): ~1.5 ms at batch 1, an estimate. 2.5 GFLOP a token at ~550 TFLOP/s;
    # 32 KiB of bf16 K/V a token (16 layers x 8 KV heads x 64 x 2 x 2 bytes) at 3.35 TB/s.
    "h100-1b": DeviceProfile(
        base_s=1.5e-3,
        per_token_s=5.0e-6,
        per_context_s=1.0e-8,
        source="estimate: 2.5 GB bf16 weights of a 1B model at H100 3.35 TB/s",
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
