"""What each form of the draft costs and how often it agrees with the target.

For every draft precision (`cluster.runtime.quantize`) and trimmed vocabulary size
(`cluster.runtime.vocab`) in a grid, the draft is loaded on its own and measured two ways:

- `ms_per_token`: decoding one token with a KV cache on one intra-op thread (a replica's
  default), the median of `steps` steps after a warm-up;
- `agreement`: how often its greedy choice equals the target's next token, with the target's
  own greedy output as the context (teacher forcing): per category of prompts, and overall. A
  greedy block's first token is accepted exactly this often; later tokens need the earlier ones
  to be accepted too.

Nothing here changes what the service outputs: every form is lossless (the verifier accepts
against the q the draft really used), and only the time per accepted token moves.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cluster.runtime.model_spec import ModelSpec
from cluster.runtime.models import load_model

PRECISIONS = ("none", "int8", "int8-dynamic")
VOCAB_SIZES = (0, 65536, 32768, 16384)
"""Trimmed vocabulary sizes measured (0: the full vocabulary)."""
STEPS = 16
WARMUP = 3


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
) -> list[dict[str, Any]]:
    """ms/token and agreement of each (precision, vocabulary) form of `draft`, on one thread
    (the caller's thread count is restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    context = examples[0].prompt if examples else (0,)
    rows = []
    try:
        for precision in precisions:
            for size in vocab_sizes:
                if precision == "int8-dynamic" and draft.device.startswith("cuda"):
                    continue  # a CPU-only form
                spec = dataclasses.replace(draft, quantization=precision, trimmed_vocab=size)
                model = load_model(spec).model
                row: dict[str, Any] = {
                    "quantization": precision,
                    "vocab": size or "full",
                    "ms_per_token": decode_ms_per_token(model, context),
                    "agreement": agreement(model, examples),
                }
                rows.append(row)
                progress(
                    f"draft {precision}, vocab {row['vocab']}: {row['ms_per_token']:.1f} ms/token, "
                    f"agreement {row['agreement']['all']:.3f}"
                )
                del model
    finally:
        torch.set_num_threads(threads)
    return rows
