"""What each form of the draft costs and how often it agrees with the target.

For every draft precision (`cluster.runtime.quantize`) and trimmed vocabulary size
(`cluster.runtime.vocab`) in a grid, the draft is loaded on its own and measured two ways:

- `ms_per_token`: decoding one token with a KV cache on one intra-op thread (a replica's
  default), the median of `steps` steps after a warm-up;
- `agreement`: how often its greedy choice equals the target's next token, with the target's
  own greedy output as the context (teacher forcing): per category of prompts, and overall. A
  greedy block's first token is accepted exactly this often; later tokens need the earlier ones
  to be accepted too.

`python -m cluster.tools.bench.draft_forms --preset qwen-coder --self` runs it on its own: the
target's greedy continuations and its ms/token as the cost reference, then the preset's draft
and (`--self`) the target's own weights as the draft, with each form's cost ratio and the
speedup the i.i.d. estimate implies for k = 2..6 (`implied_speedup`).

Nothing here changes what the service outputs: every form is lossless (the verifier accepts
against the q the draft really used), and only the time per accepted token moves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from cluster.runtime.model_spec import ModelSpec
from cluster.runtime.models import load_model
from cluster.runtime.quantize import INT4_GROUP_SIZE, check_group_size, quantize_weights

PRECISIONS = ("none", "int8", "int8-dynamic", "int4")
VOCAB_SIZES = (0, 65536, 32768, 16384)
"""Trimmed vocabulary sizes measured (0: the full vocabulary)."""
STEPS = 16
WARMUP = 3
SPEEDUP_BLOCKS = (2, 3, 4, 5, 6)
"""Draft lengths k the command line's implied speedups are estimated for."""


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt's tokens followed by the target's greedy continuation."""

    prompt: tuple[int, ...]
    continuation: tuple[int, ...]
    category: str


def decode_ms_per_token(model: Any, context: Sequence[int], steps: int = STEPS) -> float:
    """Median ms of one decode step with a KV cache, after prefilling `context`."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model(torch.tensor([list(context)], device=device), use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(WARMUP + steps):
            start = time.perf_counter()
            out = model(token, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - start)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return 1000 * statistics.median(times[WARMUP:])


def agreement(model: Any, examples: Sequence[Example]) -> dict[str, float]:
    """Share of continuation tokens the model's greedy choice equals, given every token before
    it: per category and `all`."""
    device = next(model.parameters()).device
    hits: dict[str, list[int]] = {}
    with torch.inference_mode():
        for example in examples:
            if not example.continuation:
                continue
            ids = torch.tensor([[*example.prompt, *example.continuation]], device=device)
            logits = model(ids).logits[0]
            start = len(example.prompt) - 1
            chosen = logits[start : start + len(example.continuation)].argmax(-1).cpu()
            same = int((chosen == torch.tensor(example.continuation)).sum())
            tally = hits.setdefault(example.category, [0, 0])
            tally[0] += same
            tally[1] += len(example.continuation)
    out = {category: same / total for category, (same, total) in hits.items()}
    out["all"] = sum(h[0] for h in hits.values()) / max(1, sum(h[1] for h in hits.values()))
    return out


def measure_forms(
    draft: ModelSpec,
    examples: Sequence[Example],
    progress: Callable[[str], None],
    precisions: Sequence[str] = PRECISIONS,
    vocab_sizes: Sequence[int] = VOCAB_SIZES,
    group_sizes: Sequence[int] = (INT4_GROUP_SIZE,),
) -> list[dict[str, Any]]:
    """ms/token and agreement of each (precision, vocabulary) form of `draft`, `int4` once per
    group size, on one thread (the caller's thread count is restored afterwards)."""
    context = examples[0].prompt if examples else (0,)
    rows = []
    with one_thread():
        for precision in precisions:
            for size in vocab_sizes:
                if precision == "int8-dynamic" and draft.device.startswith("cuda"):
                    continue  # a CPU-only form
                for group in group_sizes if precision == "int4" else (0,):
                    spec = dataclasses.replace(draft, quantization=precision, trimmed_vocab=size)
                    model = _load_form(spec, group)
                    row: dict[str, Any] = {
                        "quantization": precision,
                        "vocab": size or "full",
                        "ms_per_token": decode_ms_per_token(model, context),
                        "agreement": agreement(model, examples),
                    }
                    if group:
                        row["group_size"] = group
                    rows.append(row)
                    progress(
                        f"draft {form_name(row)}, vocab {row['vocab']}: "
                        f"{row['ms_per_token']:.1f} ms/token, "
                        f"agreement {row['agreement']['all']:.3f}"
                    )
                    del model
    return rows


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread, as a replica runs; the caller's count restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def form_name(row: dict[str, Any]) -> str:
    """`int4/g64` for an int4 form, else its quantization."""
    group = row.get("group_size")
    return f"{row['quantization']}/g{group}" if group else str(row["quantization"])


def expected_tokens(agreement: float, num_draft_tokens: int) -> float:
    """Tokens a greedy round yields when each drafted token is accepted with probability
    `agreement`, independently (the usual i.i.d. estimate): (1 - a^(k+1)) / (1 - a)."""
    if agreement >= 1.0:
        return float(num_draft_tokens + 1)
    return (1.0 - agreement ** (num_draft_tokens + 1)) / (1.0 - agreement)


def implied_speedup(agreement: float, cost_ratio: float, num_draft_tokens: int) -> float:
    """The serial estimate against the target alone: a round costs k drafted tokens at
    `cost_ratio` of a target token each, plus one verify priced as one target token."""
    return expected_tokens(agreement, num_draft_tokens) / (num_draft_tokens * cost_ratio + 1.0)


def _load_form(spec: ModelSpec, group_size: int) -> Any:
    """`spec`'s model; an int4 form quantized with `group_size` input channels a group."""
    if spec.quantization != "int4":
        return load_model(spec).model
    loaded = load_model(dataclasses.replace(spec, quantization="none"))
    return quantize_weights(loaded.model, "int4", loaded.device, group_size=group_size)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cluster.tools.bench.draft_forms", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--preset", default="qwen-coder")
    parser.add_argument("--prompts", help="jsonl as for tandem bench (default: its prompt set)")
    parser.add_argument("--max-tokens", type=int, default=48, help="target continuation length")
    parser.add_argument("--draft", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the preset's draft model (default: on)")  # fmt: skip
    parser.add_argument("--precisions", nargs="+", help="its forms (default: the preset's)")
    parser.add_argument("--vocab", nargs="+", type=int, help="its vocabularies (the preset's)")
    parser.add_argument("--self", dest="self_draft", action="store_true",
                        help="measure the target's own weights as the draft too")  # fmt: skip
    parser.add_argument("--self-precisions", nargs="+", default=["int8", "int4"])
    parser.add_argument("--self-vocab", nargs="+", type=int, default=[0])
    parser.add_argument("--group-sizes", nargs="+", type=int, default=[INT4_GROUP_SIZE])
    parser.add_argument("--out", help="write the result as JSON here too")
    args = parser.parse_args(argv)
    if args.max_tokens < 2:
        parser.error("--max-tokens must be >= 2")
    for size in args.group_sizes:
        try:
            check_group_size(size)
        except ValueError as error:
            parser.error(str(error))
    result = measure(args, lambda line: print(line, file=sys.stderr, flush=True))
    print(format_table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def measure(args: Any, progress: Callable[[str], None]) -> dict[str, Any]:
    """The target's cost and self-agreement, then each asked model's forms, with cost ratios."""
    from cluster.presets import PRESETS, resolve_pair
    from cluster.tools.prompt_files import load_prompts

    pair = resolve_pair(args.preset)
    preset = PRESETS[args.preset]
    target = load_model(pair.target)
    prompts = load_prompts(args.prompts)
    examples = []
    model: Any = target.model  # transformers' generate is opaque to type checkers
    with torch.inference_mode():
        for prompt in prompts:
            ids = target.tokenizer.encode(prompt.text, add_special_tokens=False)
            out = model.generate(
                torch.tensor([ids], device=target.device),
                max_new_tokens=args.max_tokens,
                do_sample=False,
            )
            continuation = tuple(out[0, len(ids) :].tolist())
            examples.append(Example(tuple(ids), continuation, prompt.category))
    progress(f"target continuations: {sum(len(e.continuation) for e in examples)} tokens")
    with one_thread():
        reference = {
            "quantization": pair.target.quantization,
            "vocab": "full",
            "ms_per_token": decode_ms_per_token(target.model, examples[0].prompt),
            "agreement": agreement(target.model, examples),
        }
    progress(f"target: {reference['ms_per_token']:.1f} ms/token")
    del target, model
    forms: list[dict[str, Any]] = []
    drafts = []
    if args.draft:
        precisions = args.precisions or [preset.draft_quantization]
        drafts.append(("draft", pair.draft, precisions, args.vocab or [preset.draft_vocab]))
    if args.self_draft:
        drafts.append(("self", pair.target, args.self_precisions, args.self_vocab))
    for model, spec, precisions, sizes in drafts:
        for row in measure_forms(spec, examples, progress, precisions, sizes, args.group_sizes):
            forms.append({"model": model, **row})
    for row in forms:
        cost = row["ms_per_token"] / reference["ms_per_token"]
        row["cost_ratio"] = cost
        row["implied_speedup"] = {
            k: implied_speedup(row["agreement"]["all"], cost, k) for k in SPEEDUP_BLOCKS
        }
    return {"preset": args.preset, "max_tokens": args.max_tokens, "target": reference,
            "forms": forms}  # fmt: skip


def format_table(result: dict[str, Any]) -> str:
    """A markdown table: a row per form, the target's first."""
    target = result["target"]
    categories = [c for c in target["agreement"] if c != "all"] + ["all"]
    header = ["model", "form", "vocab", "ms/token", "cost", *categories]
    header += [f"k={k}" for k in SPEEDUP_BLOCKS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    rows = [{"model": "target", **target, "cost_ratio": 1.0, "implied_speedup": {}}]
    for row in [*rows, *result["forms"]]:
        cells = [row["model"], form_name(row), str(row["vocab"]), f"{row['ms_per_token']:.1f}",
                 f"{row['cost_ratio']:.3f}"]  # fmt: skip
        cells += [f"{100 * row['agreement'][c]:.1f}%" for c in categories]
        cells += [f"{row['implied_speedup'][k]:.2f}" if k in row["implied_speedup"] else ""
                  for k in SPEEDUP_BLOCKS]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
