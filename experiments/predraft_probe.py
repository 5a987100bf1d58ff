"""Does the pre-drafting budget pay, or keep out of the way, on a preset? One stream, in process.

`python -m experiments.predraft_probe --preset qwen-coder` loads the pair in this process
with the adaptive plan on, and generates each prompt pipelined twice per repeat, interleaved:
without pre-drafting (fan-out 0) and with the plan free to pre-draft up to `--fan-out`. It
prints, per run, tokens/s, the rounds the plan pre-drafted and their hits, and at the end the
medians and their ratio. Where drafter and verifier share the cores (a real pair on this
CPU), the budget should keep pre-drafting off and the ratio near 1.

Timing is wall time of whole requests, medians over prompts and repeats; nothing runs beside
it. The router is closed on any exit (Ctrl-C included); the models are this process's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from typing import Any

from cluster.runtime.limits import MAX_PREDRAFT_FAN_OUT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.predraft_probe")
    parser.add_argument("--preset", default="qwen-coder")
    parser.add_argument("--prompts", help="jsonl as for tandem bench (default: its prompt set)")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--fan-out", type=int, default=MAX_PREDRAFT_FAN_OUT)
    args = parser.parse_args(argv)
    if not 1 <= args.fan_out <= MAX_PREDRAFT_FAN_OUT:
        parser.error(f"--fan-out must be in 1..{MAX_PREDRAFT_FAN_OUT}")
    if args.num_prompts < 1 or args.repeats < 1 or args.max_tokens < 2:
        parser.error("--num-prompts and --repeats must be >= 1, --max-tokens >= 2")
    result = probe(args)
    for fan_out in (0, args.fan_out):
        print(f"fan-out up to {fan_out}: median {result[fan_out]:.2f} tokens/s")
    print(f"with pre-drafting / without: {result[args.fan_out] / result[0]:.3f}")
    return 0


def probe(args: Any) -> dict[int, float]:
    """Median tokens/s by fan-out cap (0 and `args.fan_out`)."""
    from cluster.local import build_local
    from cluster.presets import resolve_pair
    from cluster.routing.draft_length_config import DraftLengthConfig
    from cluster.routing.request import GenerationRequest
    from cluster.tools.prompt_files import load_prompts

    local = build_local(resolve_pair(args.preset), draft_length=DraftLengthConfig(enabled=True))
    try:
        texts = [p.text for p in load_prompts(args.prompts)][: args.num_prompts]
        prompts = [tuple(local.tokenizer.encode(t, add_special_tokens=False)) for t in texts]
        rates: dict[int, list[float]] = {0: [], args.fan_out: []}
        for repeat in range(args.repeats):
            for index, prompt in enumerate(prompts):
                caps = (0, args.fan_out) if (repeat + index) % 2 == 0 else (args.fan_out, 0)
                for cap in caps:
                    request = GenerationRequest(
                        prompt, args.max_tokens, draft_tokens=args.draft_tokens,
                        predraft_fan_out=cap,
                    )  # fmt: skip
                    started = time.perf_counter()
                    result = local.router.generate(request, pipelined=True)
                    rate = len(result.tokens) / (time.perf_counter() - started)
                    rates[cap].append(rate)
                    stats = result.stats
                    rounds = Counter(predrafted=stats.predraft_hits + stats.predraft_misses,
                                     verify_passes=stats.num_verify_passes)  # fmt: skip
                    print(f"prompt {index} fan-out up to {cap}: {rate:.2f} tokens/s, "
                          f"{rounds['predrafted']} of {rounds['verify_passes']} rounds "
                          f"pre-drafted, {stats.predraft_hits} hits",
                          file=sys.stderr, flush=True)  # fmt: skip
        return {cap: statistics.median(values) for cap, values in rates.items()}
    finally:
        local.router.close()


if __name__ == "__main__":
    sys.exit(main())
