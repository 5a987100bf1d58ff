"""The demo: one prompt through a running service, speculative against the target alone.

`run_demo` streams a greedy generation with speculation (the service's default draft length and
pipelining), writing text as it is committed, then runs the same prompt with draft length 0:
the target alone through the same service path. It reports what a user wants to see first:
acceptance, tokens per verify pass, pipeline hits, and the speedup over target-only on this
prompt, with whether both runs produced the same tokens (greedy decoding is lossless, so they
must in float32; bfloat16 can flip a near-tie, see docs/models.md). One prompt, one run each: a
demonstration, not a benchmark (`tandem bench` measures speed properly).

The report also says where the drafted tokens came from (the draft model, prompt lookup, the
suffix drafter) and which drafting the request's own measurement kept, and why
(`cluster.routing.draft_modes`). `tandem demo` runs two cases: novel text (a function to
write), where only a draft model can guess ahead, and the edit of a file given in the prompt,
the common case for a coding agent, where prompt lookup copies what the output repeats.

The client is injected, so the demo runs against any `TandemClient`-shaped object.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.api.client_types import RequestStats

WARMUP_TOKENS = 4
"""A first short request, untimed: a fresh replica's first forward pass pays one-time costs."""


@dataclass(frozen=True)
class DemoReport:
    """What the demo measured: the speculative stream and the target-only run of one prompt."""

    stats: RequestStats
    speculative_s: float
    target_only_s: float
    num_target_only_tokens: int
    num_same_leading_tokens: int
    """How many leading tokens both runs share (all of them unless bf16 flipped a near-tie)."""

    @property
    def same_tokens(self) -> bool:
        count = self.stats.num_generated_tokens
        return count == self.num_target_only_tokens == self.num_same_leading_tokens

    @property
    def acceptance_rate(self) -> float | None:
        return self.stats.num_accepted / self.stats.num_drafted if self.stats.num_drafted else None

    @property
    def tokens_per_verify(self) -> float | None:
        passes = self.stats.num_verify_passes
        return self.stats.num_generated_tokens / passes if passes else None

    @property
    def pipeline_hit_rate(self) -> float | None:
        rounds = self.stats.pipeline_hits + self.stats.pipeline_misses
        return self.stats.pipeline_hits / rounds if rounds else None

    @property
    def speedup(self) -> float:
        speculative = self.stats.num_generated_tokens / self.speculative_s
        return speculative / (self.num_target_only_tokens / self.target_only_s)


def run_demo(client: Any, prompt: str, max_tokens: int, write: Callable[[str], None]) -> DemoReport:
    """Stream `prompt` with speculation (text to `write`), then time the target alone."""
    client.generate(prompt, max_tokens=WARMUP_TOKENS)
    tokens: list[int] = []
    stats: RequestStats | None = None
    started = time.perf_counter()
    for chunk in client.stream(prompt, max_tokens=max_tokens, temperature=0.0):
        write(chunk.text)
        tokens.extend(chunk.tokens)
        stats = chunk.stats or stats
    speculative_s = time.perf_counter() - started
    if stats is None:
        raise RuntimeError("the stream ended without its final chunk")
    started = time.perf_counter()
    alone = client.generate(prompt, max_tokens=max_tokens, temperature=0.0, draft_tokens=0)
    target_only_s = time.perf_counter() - started
    return DemoReport(
        stats=stats,
        speculative_s=speculative_s,
        target_only_s=target_only_s,
        num_target_only_tokens=len(alone.tokens),
        num_same_leading_tokens=_common_prefix(tokens, alone.tokens),
    )


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    # Unequal lengths are expected (an end-of-sequence token in one run only).
    pairs = zip(a, b, strict=False)
    return next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


def drafted_by(stats: RequestStats) -> str:
    """Drafted and accepted tokens by where they came from: the draft model, prompt lookup,
    the suffix drafter."""
    lookup_drafted = stats.num_drafted - stats.model_drafted - stats.suffix_drafted
    lookup_accepted = stats.num_accepted - stats.model_accepted - stats.suffix_accepted
    parts = [
        ("draft model", stats.model_drafted, stats.model_accepted),
        ("prompt lookup", lookup_drafted, lookup_accepted),
        ("suffix drafter", stats.suffix_drafted, stats.suffix_accepted),
    ]
    return ", ".join(f"{name} {accepted}/{drafted} accepted" for name, drafted, accepted in parts)


def format_report(report: DemoReport) -> str:
    stats = report.stats
    per_verify = report.tokens_per_verify
    lines = [
        f"speculative:  {stats.num_generated_tokens} tokens in {report.speculative_s:.1f} s "
        f"({stats.num_generated_tokens / report.speculative_s:.1f} tokens/s)",
        f"  acceptance {_percent(report.acceptance_rate)} of {stats.num_drafted} drafted, "
        f"{'n/a' if per_verify is None else f'{per_verify:.2f}'} tokens per verify pass, "
        f"pipeline hits {_percent(report.pipeline_hit_rate)}",
        f"target alone: {report.num_target_only_tokens} tokens in {report.target_only_s:.1f} s "
        f"({report.num_target_only_tokens / report.target_only_s:.1f} tokens/s)",
        f"speedup over target-only: {report.speedup:.2f}x on this prompt",
    ]
    lines.append(f"  drafted: {drafted_by(stats)}")
    if stats.draft_mode:
        lines.append(f"  drafting kept: {stats.draft_mode} ({stats.draft_mode_reason})")
    if report.same_tokens:
        lines.append("same tokens as the target alone: yes")
    else:
        lines.append(
            f"same tokens as the target alone: the first {report.num_same_leading_tokens}; "
            "reduced precision (bfloat16) can flip a near-tie between two tokens, "
            "float32 output is exact"
        )
    return "\n".join(lines)
