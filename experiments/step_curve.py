"""What one forward pass costs by the rows it carries, per precision, on this host.

`python -m experiments.step_curve --preset qwen-coder` loads the preset's target in each of
bfloat16, float32 and int8 weights (bf16 activations), and the service's draft as the preset
builds it, and times one forward pass with a KV cache over a `--context`-token prompt for each
row count in `--rows`: the cost of a verify pass of a (rows - 1)-token block. It prints a
table of medians over `--repeats` (ms, and each as a multiple of the 1-row pass), the host's
instruction sets (`lscpu`'s flags: AVX-512, bf16, VNNI, AMX), and the draft's step over each
target's.

One model is loaded at a time and freed before the next, so the peak is one float32 target.
Timing is wall time with `--threads` torch threads (the service's replicas split the cores
between them); nothing runs beside it. The figures are in docs/models.md ("The host
decides").
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

DEFAULT_ROWS = (1, 2, 3, 5, 9, 17)
FORMS = ("target bf16", "target fp32", "target int8", "draft")
"""The models timed: the target in three precisions, and the preset's draft."""

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.step_curve")
    parser.add_argument("--preset", default="qwen-coder")
    parser.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS))
    parser.add_argument("--context", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS))
    args = parser.parse_args(argv)
    if min(args.rows) < 1 or args.context < 1 or args.repeats < 1 or args.threads < 1:
        parser.error("--rows, --context, --repeats and --threads must be >= 1")
    import torch

    torch.set_num_threads(args.threads)
    print(f"host: {host_line()}; {args.threads} torch threads, context {args.context}")
    curves: dict[str, list[float]] = {}
    for form in args.forms:
        curves[form] = time_form(args.preset, form, args.rows, args.context, args.repeats)
    print(table(curves, args.rows))
    if "draft" in curves:
        for form, costs in curves.items():
            if form != "draft":
                print(f"draft step / {form} step: {curves['draft'][0] / costs[0]:.2f}")
    return 0


def host_line(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name and which of `ISA_FLAGS` it has ("unknown" off Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return "unknown"
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                  if ln.startswith("model name")), "unknown")  # fmt: skip
    flags = next((set(ln.split(":", 1)[1].split()) for ln in text.splitlines()
                  if ln.startswith("flags")), set())  # fmt: skip
    present = [flag for flag in ISA_FLAGS if flag in flags]
    return f"{model} ({', '.join(present) or 'none of ' + ', '.join(ISA_FLAGS)})"


def spec_of(preset: str, form: str) -> Any:
    """The ModelSpec `form` loads from `preset`'s pair."""
    from cluster.presets import resolve_pair

    if form == "draft":
        return resolve_pair(preset).draft
    dtype = "float32" if form == "target fp32" else "bfloat16"
    target = resolve_pair(preset, dtype=dtype).target
    return replace(target, quantization="int8") if form == "target int8" else target


def time_form(preset: str, form: str, rows: list[int], context: int, repeats: int) -> list[float]:
    """Median seconds of one forward pass of each row count, after `context` cached tokens."""
    import torch

    from cluster.runtime.models import load_model

    loaded = load_model(spec_of(preset, form))
    model, device = loaded.model, loaded.device
    vocab = min(loaded.vocab_size, len(loaded.tokenizer))
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, context), generator=generator).to(device)
    medians = []
    with torch.inference_mode():
        warm = model(prompt, use_cache=True)
        cache = warm.past_key_values
        for count in rows:
            block = torch.randint(0, vocab, (1, count), generator=generator).to(device)
            times = []
            for _ in range(repeats + 1):  # the first is a warm-up
                start = time.perf_counter()
                model(block, past_key_values=cache, use_cache=True)
                times.append(time.perf_counter() - start)
                cache.crop(-count)  # back to the context alone
            medians.append(statistics.median(times[1:]))
            print(f"{form}: {count} rows {medians[-1] * 1000:.1f} ms", flush=True)
    del loaded, model, cache, warm
    gc.collect()
    return medians


def table(curves: dict[str, list[float]], rows: list[int]) -> str:
    """A markdown table: ms per pass, and each over the form's own 1-row pass."""
    head = "| rows in the pass | " + " | ".join(str(r) for r in rows) + " |"
    lines = [head, "|---" * (len(rows) + 1) + "|"]
    for form, costs in curves.items():
        cells = [f"{costs[0] * 1000:.0f} ms"]
        cells += [f"{c * 1000:.0f} ({c / costs[0]:.2f}x)" for c in costs[1:]]
        lines.append(f"| {form} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
