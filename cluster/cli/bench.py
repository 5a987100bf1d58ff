"""`tandem bench`: see `cluster.tools.bench.run`; writes the JSON result, a PNG chart, and a
table."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from cluster.runtime.model_spec import QUANTIZATIONS


def add_to(commands: Any) -> None:
    p = commands.add_parser("bench", help="Tandem against Hugging Face on the same prompts")
    p.add_argument("--preset", default="tiny", help="model pair (default: tiny)")
    p.add_argument("--mode", choices=("local", "service"), default="local")
    p.add_argument("--prompts", help="jsonl with 'prompt' and optional 'category'")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--dtype", help="float32, bfloat16 or float16 (default: the preset's)")
    on_off = argparse.BooleanOptionalAction
    p.add_argument(
        "--prompt-lookup",
        action=on_off,
        help="copy recurring text first (default: the service's, on)",
    )
    p.add_argument(
        "--suffix-drafter",
        action=on_off,
        help="draft from earlier requests' text before the model (default: the service's, on; "
        "--mode local only: each run and repeat drafts from its own earlier prompts only)",
    )
    p.add_argument(
        "--adaptive-draft",
        action=on_off,
        help="choose block lengths and pipelining per round (default: the service's, on)",
    )
    p.add_argument(
        "--draft-quantization",
        choices=QUANTIZATIONS,
        help="the draft's weights in Tandem's runs (default: the service's, else the preset's); "
        "HF assisted always drafts with the plain model",
    )
    p.add_argument(
        "--draft-vocab", type=int, metavar="N",
        help="Tandem's draft scores the N most frequent ids (default: the preset's)",
    )  # fmt: skip
    p.add_argument(
        "--draft-forms",
        action="store_true",
        help="also measure every draft precision and vocabulary: ms/token and agreement",
    )
    p.add_argument(
        "--serve-config", help="--mode service: a TandemConfig YAML for the service it starts"
    )
    p.add_argument("--repeats", type=int, default=3, help="median of this many (at least 3)")
    p.add_argument("--json", dest="json_out", help="write the result here")
    p.add_argument("--plot", help="write the chart here (PNG)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from cluster.cli.output import write_result
    from cluster.runtime.errors import InvalidArgumentError
    from cluster.tools.bench.report import format_table, plot
    from cluster.tools.bench.run import run_bench

    if args.repeats < 3:
        raise InvalidArgumentError(
            f"--repeats must be >= 3 (medians of repeats), got {args.repeats}"
        )
    if args.serve_config and args.mode != "service":
        raise InvalidArgumentError("--serve-config needs --mode service")
    if args.draft_vocab is not None and args.draft_vocab < 0:
        raise InvalidArgumentError(f"--draft-vocab must be >= 0, got {args.draft_vocab}")
    if args.max_tokens < 1 or args.draft_tokens < 1:
        raise InvalidArgumentError("--max-tokens and --draft-tokens must be >= 1")
    if args.plot:
        from cluster.tools.bench.output import pyplot

        pyplot()  # installed, before the run rather than after it
    started = time.monotonic()

    def progress(message: str) -> None:
        print(f"[{time.monotonic() - started:7.1f}s] {message}", file=sys.stderr, flush=True)

    from cluster.tools.bench.sim import format_sim_table, is_sim_preset, run_sim_bench

    if is_sim_preset(args.preset):
        result = run_sim_bench(args, progress)
        write_result(result, args.json_out, None, plot, format_sim_table)
        return 0
    result = run_bench(args, progress)
    write_result(result, args.json_out, args.plot, plot, format_table)
    return 0
