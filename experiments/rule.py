"""The seed-exact rule against rejection sampling: acceptance and speed, by prompt category.

`python -m experiments.rule --preset qwen-coder --temperature 0.7` runs every prompt of
a set (`tandem bench`'s, with categories) under each seed through one in-process Tandem, once
per rule, the two rules interleaved and their order alternated per seed, and reports per
category and overall: acceptance (accepted over drafted tokens, summed over requests), tokens
per verify pass, and generated tokens per second (each rule's, all tokens over all seconds of
its requests, and their ratio). The block length is fixed (`--draft-tokens`), with the adaptive
plan and prompt lookup off, so both rules see the same blocks from the same draft model: what
differs is only how drafts are drawn and accepted. Progress goes to stderr, one line per
request pair.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cluster.tools.bench.output import figure
from cluster.tools.prompt_files import Prompt, load_prompts

RULES = ("seed_exact", "rejection")


@dataclass
class RuleTally:
    """One rule's counters over some requests."""

    drafted: int = 0
    accepted: int = 0
    passes: int = 0
    tokens: int = 0
    seconds: float = 0.0
    requests: int = 0

    def add(self, drafted: int, accepted: int, passes: int, tokens: int, seconds: float) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.passes += passes
        self.tokens += tokens
        self.seconds += seconds
        self.requests += 1

    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def summary(self) -> dict[str, Any]:
        return {
            "acceptance": self.accepted / self.drafted if self.drafted else None,
            "tokens_per_pass": self.tokens / self.passes if self.passes else None,
            "tokens_per_s": self.tokens_per_s(),
            "drafted": self.drafted,
            "accepted": self.accepted,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "requests": self.requests,
        }


def run(args: argparse.Namespace) -> dict[str, Any]:
    # Loading torch and the models takes seconds: only once the flags are known.
    from cluster.local import build_local
    from cluster.presets import resolve_pair
    from cluster.routing.draft_length_config import DraftLengthConfig
    from cluster.routing.request import GenerationRequest
    from cluster.runtime.sampling_params import SamplingParams
    from drafter.config import NgramConfig

    prompts: list[Prompt] = load_prompts(args.prompts)
    pair = resolve_pair(args.preset, None, None, args.dtype, args.device)
    tandem = build_local(
        pair,
        prompt_lookup=NgramConfig(enabled=False),
        draft_length=DraftLengthConfig(enabled=False),
    )
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    tallies: dict[str, dict[str, RuleTally]] = defaultdict(lambda: defaultdict(RuleTally))
    try:
        for index, prompt in enumerate(prompts):
            ids = tuple(tandem.tokenizer.encode(prompt.text, add_special_tokens=False))
            for seed in args.seeds:
                order = RULES if (index + seed) % 2 == 0 else RULES[::-1]
                speeds: dict[str, float] = {}
                for rule in order:
                    request = GenerationRequest(
                        ids,
                        args.max_tokens,
                        replace(sampling, seed_exact=rule == "seed_exact"),
                        seed=seed,
                        draft_tokens=args.draft_tokens,
                    )
                    started = time.perf_counter()
                    result = tandem.router.generate(request, pipelined=False)
                    seconds = time.perf_counter() - started
                    stats = result.stats
                    for key in (prompt.category, "all"):
                        tallies[key][rule].add(
                            stats.num_drafted,
                            stats.num_accepted,
                            stats.num_verify_passes,
                            len(result.tokens),
                            seconds,
                        )
                    speeds[rule] = len(result.tokens) / seconds
                print(
                    f"[{index + 1}/{len(prompts)}] {prompt.category} seed {seed}: "
                    + ", ".join(f"{rule} {speeds[rule]:.2f} tok/s" for rule in RULES),
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        tandem.router.close()
    return {
        "config": {
            "preset": args.preset,
            "dtype": str(pair.target.dtype) if hasattr(pair.target, "dtype") else args.dtype,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "draft_tokens": args.draft_tokens,
            "max_tokens": args.max_tokens,
            "seeds": list(args.seeds),
            "prompts": args.prompts or "default",
        },
        "by_category": {
            key: {
                **{rule: tallies[key][rule].summary() for rule in RULES},
                "speed_ratio": tallies[key]["seed_exact"].tokens_per_s()
                / tallies[key]["rejection"].tokens_per_s(),
            }
            for key in tallies
        },
    }


def noise_cost(args: argparse.Namespace) -> dict[str, Any]:
    """What the seed-exact draw costs on the target's own rows: for every prompt, the target's
    last (up to) 40 positions at `args.temperature`, how many ids are candidates (the noise is
    computed for those only) and the milliseconds `gumbel_tokens` takes per row, in blocks of 5
    rows (a 4-token block and its bonus), on one thread."""
    import torch

    from cluster.presets import resolve_pair
    from cluster.runtime.gumbel import CANDIDATE_RATIO, gumbel_tokens
    from cluster.runtime.models import load_model
    from cluster.runtime.sampling import logits_to_probs
    from cluster.runtime.sampling_params import SamplingParams

    torch.set_num_threads(1)
    target = load_model(resolve_pair(args.preset, None, None, args.dtype, args.device).target)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    candidates: list[int] = []
    ms_per_row: list[float] = []
    for prompt in load_prompts(args.prompts):
        ids = target.tokenizer.encode(prompt.text, add_special_tokens=False)
        with torch.inference_mode():
            logits = target.model(torch.tensor([ids], device=target.device)).logits[0, -40:]
        probs = logits_to_probs(logits.float(), sampling)
        best = probs.amax(dim=-1, keepdim=True)
        candidates += (probs >= best * CANDIDATE_RATIO).sum(dim=-1).tolist()
        for start in range(0, probs.shape[0] - 4, 5):
            started = time.perf_counter()
            gumbel_tokens(probs[start : start + 5], [1] * 5, list(range(5)))
            ms_per_row.append((time.perf_counter() - started) / 5 * 1e3)
    candidates.sort()
    ms_per_row.sort()
    return {
        "vocab": target.vocab_size,
        "rows": len(candidates),
        "candidates_median": statistics.median(candidates),
        "candidates_p90": candidates[int(0.9 * len(candidates))],
        "ms_per_row_median": statistics.median(ms_per_row),
        "ms_per_row_p90": ms_per_row[int(0.9 * len(ms_per_row))],
    }


def table(result: dict[str, Any]) -> str:
    lines = ["category    acceptance (seed-exact / rejection)   tokens/pass        tok/s ratio"]
    for key, row in result["by_category"].items():
        exact, rejection = row["seed_exact"], row["rejection"]
        lines.append(
            f"{key:<11} {figure(exact['acceptance'], 3)} / {figure(rejection['acceptance'], 3)}"
            f"{'':<22}{figure(exact['tokens_per_pass'], 2)} / "
            f"{figure(rejection['tokens_per_pass'], 2)}{'':<7}{row['speed_ratio']:.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.rule", description=__doc__)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--dtype", help="float32, bfloat16 or float16 (default: the preset's)")
    parser.add_argument("--device", help="cpu or cuda (default: the preset's)")
    parser.add_argument("--prompts", help="jsonl with 'prompt' and 'category' (default: bench's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", help="write the result here")
    parser.add_argument(
        "--noise-cost",
        action="store_true",
        help="instead, measure the seed-exact draw's cost on the target's own rows",
    )
    args = parser.parse_args(argv)
    if args.noise_cost:
        print(json.dumps(noise_cost(args), indent=2))
        return 0
    result = run(args)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
