"""Every drafter kind on the same prompts, by category: which pays where? One stream, in process.

`python -m experiments.drafter_kinds --preset qwen-coder --prompts FILE` loads the pair
in this process (the adaptive plan and prompt lookup on, as `tandem serve` runs them) and runs
each prompt once per mode and repeat, the modes interleaved and their order rotated:

- `target`: the target alone (draft length 0);
- `model`: the preset's draft model drafts (no suffix drafter);
- `suffix+model`: the suffix drafter is asked first, the draft model otherwise;
- with `--self-preset P` (a preset whose draft is the target's own quantized copy, e.g.
  `qwen-coder-self-int4`): `self` and `suffix+self`, the same with that draft instead;
- with `--hf-assisted`: Hugging Face assisted generation with the preset's plain draft;
- with `--variant KEY=VALUE[,...]`: suffix+model again with other suffix drafter settings
  (`--suffix KEY=VALUE` changes them for every suffix mode; `--skip` leaves modes out).

Each mode's pass over the prompts, per repeat, is a tenant of its own, so the suffix drafter
drafts only from the prompts and answers before it in that pass (an agent's earlier turns, in
file order), never from the same prompt's answer in another repeat or mode. Per category it
prints tokens/s per mode (each prompt's median over repeats, summed as `tandem bench` does),
the speedup over the target alone, and the suffix drafter's and the model's acceptance; with
`--json` it writes the whole result. Nothing should run beside it; the routers are closed on
any exit (Ctrl-C included).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TARGET = "target"
Generate = Callable[[tuple[int, ...], str], tuple[tuple[int, ...], Any]]
"""A mode: (prompt ids, tenant) -> (tokens, its speculation counters or None)."""


@dataclass
class Tally:
    """One mode on one prompt: its repeats' seconds and counters (summed)."""

    seconds: list[float] = field(default_factory=list)
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    suffix_drafted: int = 0
    suffix_accepted: int = 0
    same_as_target: bool | None = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.drafter_kinds")
    parser.add_argument("--preset", default="qwen-coder")
    parser.add_argument("--prompts", help="jsonl as for tandem bench (default: its prompt set)")
    parser.add_argument("--categories", nargs="*", help="only the prompts of these categories")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--self-preset", help="also draft with this preset's draft (self-draft)")
    parser.add_argument("--hf-assisted", action="store_true", help="also run HF assisted")
    parser.add_argument(
        "--suffix", action="append", default=[], metavar="KEY=VALUE",
        help="a suffix drafter setting of the suffix modes (repeatable): tokens_per_match=0",
    )  # fmt: skip
    parser.add_argument(
        "--variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
        help="also run suffix+model with these settings, as the mode suffix[KEY=VALUE]+model",
    )  # fmt: skip
    parser.add_argument("--skip", nargs="*", default=[], choices=SKIPPABLE, help="modes left out")
    parser.add_argument("--json", dest="json_out", help="write the result here")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.max_tokens < 2 or args.draft_tokens < 1:
        parser.error("--repeats and --draft-tokens must be >= 1, --max-tokens >= 2")
    try:
        args.suffix_settings = settings(args.suffix)
        args.variants = {f"suffix[{v}]+model": settings(v.split(",")) for v in args.variant}
    except ValueError as error:
        parser.error(str(error))
    result = run(args, lambda line: print(line, file=sys.stderr, flush=True))
    print(format_table(result))
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump(result, out, indent=2)
    return 0


SKIPPABLE = ("model", "suffix+model")


def settings(pairs: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` pairs as SuffixConfig fields (numbers parsed, the config checks them)."""
    from drafter.config import SuffixConfig

    fields = {f.name for f in dataclasses.fields(SuffixConfig)}
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"not a suffix drafter setting: {pair!r}")
        for kind in (int, float):
            try:
                out[key] = kind(value)
                break
            except ValueError:
                out[key] = value
    SuffixConfig(**out)  # refused here, before a model loads
    return out


def run(args: Any, say: Callable[[str], None]) -> dict[str, Any]:
    from cluster.local import InProcess, build_local, text_decoder
    from cluster.presets import resolve_pair
    from cluster.routing.draft_length_config import DraftLengthConfig
    from cluster.routing.request import GenerationRequest
    from cluster.routing.router import Router
    from cluster.runtime.models import load_model
    from cluster.tools.bench.runners import hf_runner
    from cluster.tools.prompt_files import load_prompts
    from drafter.config import NgramConfig, SuffixConfig
    from drafter.drafter import Drafter
    from drafter.suffix import SuffixDrafter

    prompts = load_prompts(args.prompts)
    if args.categories:
        prompts = [p for p in prompts if p.category in args.categories]
        if not prompts:
            raise SystemExit(f"no prompt of the categories {', '.join(args.categories)}")
    pair = resolve_pair(args.preset)
    local = build_local(pair, prompt_lookup=NgramConfig(enabled=True),
                        draft_length=DraftLengthConfig(enabled=True))  # fmt: skip
    target = local.target
    routers: list[Router] = []

    def router(drafter: Any, suffix: bool, changes: dict[str, Any] | None = None) -> Router:
        config = SuffixConfig(**{**args.suffix_settings, **(changes or {})})
        made = Router(
            InProcess(local.verifier), InProcess(drafter) if drafter is not None else None,
            text_decoder(target.tokenizer), target.eos_token_ids,
            suffix=InProcess(SuffixDrafter(config)) if suffix else None,
            ngram=NgramConfig(enabled=True), draft_length=DraftLengthConfig(enabled=True),
        )  # fmt: skip
        routers.append(made)
        return made

    def speculative(made: Router, k: int) -> Generate:
        def generate(ids: tuple[int, ...], tenant: str) -> tuple[tuple[int, ...], Any]:
            request = GenerationRequest(ids, args.max_tokens, draft_tokens=k, tenant=tenant)
            result = made.generate(request, pipelined=True)
            return result.tokens, result.stats

        return generate

    try:
        # A router per mode: each router's speculation gate learns from its own requests.
        modes: dict[str, Generate] = {TARGET: speculative(router(local.drafter, False), 0)}
        if "model" not in args.skip:
            modes["model"] = speculative(router(local.drafter, False), args.draft_tokens)
        if "suffix+model" not in args.skip:
            modes["suffix+model"] = speculative(router(local.drafter, True), args.draft_tokens)
        for name, changes in args.variants.items():
            modes[name] = speculative(router(local.drafter, True, changes), args.draft_tokens)
        if args.self_preset:
            self_draft = Drafter(load_model(resolve_pair(args.self_preset).draft))
            modes["self"] = speculative(router(self_draft, False), args.draft_tokens)
            modes["suffix+self"] = speculative(router(self_draft, True), args.draft_tokens)
        if args.hf_assisted:
            plain = dataclasses.replace(pair.draft, quantization="none", trimmed_vocab=0)
            draft = load_model(plain).model
            hf = hf_runner(target.model, args.max_tokens, assistant=draft)
            modes["hf_assisted"] = lambda ids, tenant: (hf(ids)[0], None)
        ids = [tuple(local.tokenizer.encode(p.text, add_special_tokens=False)) for p in prompts]
        tallies = measure(modes, ids, args.repeats, say)
    finally:
        for made in routers:
            made.close()
    return summarize(args, [p.category for p in prompts], tallies)


def measure(
    modes: dict[str, Generate], ids: list[tuple[int, ...]], repeats: int, say: Callable[[str], None]
) -> dict[str, list[Tally]]:
    """Every mode on every prompt, `repeats` times, modes interleaved and rotated."""
    names = list(modes)
    tallies = {name: [Tally() for _ in ids] for name in names}
    targets: list[tuple[int, ...] | None] = [None] * len(ids)
    for repeat in range(repeats):
        for index, prompt in enumerate(ids):
            shift = (repeat + index) % len(names)
            for name in names[shift:] + names[:shift]:
                started = time.perf_counter()
                tokens, stats = modes[name](prompt, f"{name}-{repeat}")
                seconds = time.perf_counter() - started
                tally = tallies[name][index]
                tally.seconds.append(seconds)
                tally.tokens = len(tokens)
                if stats is not None:  # summed over repeats
                    tally.drafted += stats.num_drafted
                    tally.accepted += stats.num_accepted
                    tally.suffix_drafted += stats.suffix_drafted
                    tally.suffix_accepted += stats.suffix_accepted
                if name == TARGET:
                    targets[index] = tokens
                elif targets[index] is not None:
                    tally.same_as_target = tokens == targets[index]
                say(f"repeat {repeat + 1} prompt {index + 1} {name}: "
                    f"{len(tokens) / seconds:.2f} tokens/s, suffix {tally.suffix_accepted}/"
                    f"{tally.suffix_drafted}, all {tally.accepted}/{tally.drafted}")  # fmt: skip
    return tallies


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def summarize(args: Any, categories: list[str], tallies: dict[str, list[Tally]]) -> dict[str, Any]:
    """Per category (and `all`): tokens/s per mode, speedup over the target, acceptance."""
    out: dict[str, Any] = {}
    for category in [*dict.fromkeys(categories), "all"]:
        members = [i for i, c in enumerate(categories) if category in (c, "all")]
        row: dict[str, Any] = {"prompts": len(members), "modes": {}}
        for name, per_prompt in tallies.items():
            chosen = [per_prompt[i] for i in members]
            tokens = sum(t.tokens for t in chosen)
            seconds = sum(statistics.median(t.seconds) for t in chosen)
            drafted, accepted = sum(t.drafted for t in chosen), sum(t.accepted for t in chosen)
            s_drafted = sum(t.suffix_drafted for t in chosen)
            s_accepted = sum(t.suffix_accepted for t in chosen)
            row["modes"][name] = {
                "tokens_per_s": tokens / seconds,
                "acceptance": _ratio(accepted, drafted),
                "suffix_share": _ratio(s_drafted, drafted),
                "suffix_acceptance": _ratio(s_accepted, s_drafted),
                "model_acceptance": _ratio(accepted - s_accepted, drafted - s_drafted),
                "same_as_target": sum(t.same_as_target is True for t in chosen),
            }
        base = row["modes"][TARGET]["tokens_per_s"]
        for mode in row["modes"].values():
            mode["speedup"] = mode["tokens_per_s"] / base
        out[category] = row
    return {
        "config": {
            "preset": args.preset,
            "prompts": args.prompts or "default",
            "categories": getattr(args, "categories", None),
            "repeats": args.repeats,
            "max_tokens": args.max_tokens,
            "draft_tokens": args.draft_tokens,
            "self_preset": args.self_preset,
            "suffix": getattr(args, "suffix_settings", {}),
        },
        "by_category": out,
    }


def format_table(result: dict[str, Any]) -> str:
    """A markdown table: a row per category and mode."""
    lines = ["| category | mode | tokens/s | speedup | suffix share | suffix acc. | model acc. |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip

    def pct(value: float | None) -> str:
        return "–" if value is None else f"{100 * value:.0f}%"

    for category, row in result["by_category"].items():
        for name, mode in row["modes"].items():
            lines.append(
                f"| {category} | {name} | {mode['tokens_per_s']:.2f} | {mode['speedup']:.2f}x "
                f"| {pct(mode['suffix_share'])} | {pct(mode['suffix_acceptance'])} "
                f"| {pct(mode['model_acceptance'])} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
