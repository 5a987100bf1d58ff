"""A `tandem bench` run's samples summarized: throughput, speculation, and per category.

`RUNS` are the five configurations, in the order the result lists them (`TANDEM_RUNS`: Tandem's
three). A `Sample` is one configuration on one prompt: its repeats' times, its tokens and its
counters (`cluster.tools.bench.runners`). `summarize_run` gives a run's tokens/s and ms/token
over the median time of each prompt and, for Tandem, its `speculation_summary`: acceptance
(overall, by position, the suffix drafter's and the model's), tokens per verify pass, the ideal
speedup and the pipeline hit rate (pipelined runs only). `by_category` gives the same per prompt
category for `tandem_pipelined`, with every run's tokens/s. Pure: numbers in, dicts out.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from cluster.tools.prompt_files import Prompt

RUNS = ("hf_target", "hf_assisted", "tandem_target", "tandem_serial", "tandem_pipelined")
TANDEM_RUNS = RUNS[2:]


@dataclass
class Sample:
    """One configuration on one prompt: its repeats' times and its tokens and counters."""

    seconds: list[float] = field(default_factory=list)
    tokens: tuple[int, ...] = ()
    stats: dict[str, Any] = field(default_factory=dict)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def summarize_run(samples: list[Sample], tandem: bool, pipelined: bool) -> dict[str, Any]:
    tokens = sum(len(s.tokens) for s in samples)
    seconds = sum(statistics.median(s.seconds) for s in samples)
    run: dict[str, Any] = {
        "tokens_per_s": tokens / seconds,
        "ms_per_token": 1000 * seconds / tokens,
        "num_tokens": tokens,
    }
    if tandem:
        run.update(speculation_summary(samples))
        if not pipelined:
            run.pop("pipeline_hit_rate")
    return run


def speculation_summary(samples: list[Sample]) -> dict[str, Any]:
    def total(key: str) -> int:
        return sum(int(s.stats[key]) for s in samples)

    width = max((len(s.stats["drafted_by_position"]) for s in samples), default=0)
    drafted = [sum(s.stats["drafted_by_position"][i] for s in samples
                   if i < len(s.stats["drafted_by_position"])) for i in range(width)]  # fmt: skip
    accepted = [sum(s.stats["accepted_by_position"][i] for s in samples
                    if i < len(s.stats["accepted_by_position"])) for i in range(width)]  # fmt: skip
    tokens = sum(len(s.tokens) for s in samples)
    return {
        "acceptance_rate": _ratio(total("accepted"), total("drafted")),
        "mean_tokens_per_verify": tokens / total("passes"),
        "acceptance_by_position": [a / d for a, d in zip(accepted, drafted, strict=True) if d],
        # Free drafting and a block verified at the cost of one target step would give
        # exactly this many tokens per target step.
        "ideal_speedup": tokens / total("passes"),
        "pipeline_hit_rate": _ratio(total("hits"), total("hits") + total("misses")),
        # The suffix drafter's share of the drafted tokens, and its own acceptance.
        "suffix_share": _ratio(total("suffix_drafted"), total("drafted")),
        "suffix_acceptance_rate": _ratio(total("suffix_accepted"), total("suffix_drafted")),
        "model_acceptance_rate": _ratio(
            total("accepted") - total("suffix_accepted"),
            total("drafted") - total("suffix_drafted"),
        ),
    }


def by_category(prompts: list[Prompt], samples: dict[str, list[Sample]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for category in dict.fromkeys(p.category for p in prompts):
        members = [i for i, p in enumerate(prompts) if p.category == category]
        pipelined = [samples["tandem_pipelined"][i] for i in members]
        summary = speculation_summary(pipelined)
        out[category] = {
            "acceptance_rate": summary["acceptance_rate"],
            "suffix_acceptance_rate": summary["suffix_acceptance_rate"],
            "model_acceptance_rate": summary["model_acceptance_rate"],
            "suffix_share": summary["suffix_share"],
            "acceptance_by_position": summary["acceptance_by_position"],
            "tokens_per_s": {
                name: summarize_run([samples[name][i] for i in members], False, False)[
                    "tokens_per_s"
                ]
                for name in RUNS
            },
        }
    return out
