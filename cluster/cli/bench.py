"""`tandem bench`: see `cluster.tools.bench`; writes the JSON result, a PNG chart, and a table."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def add_to(commands: Any) -> None:
    p = commands.add_parser("bench", help="Tandem against Hugging Face on the same prompts")
    p.add_argument("--preset", default="tiny", help="model pair (default: tiny)")
    p.add_argument("--mode", choices=("local", "service"), default="local")
    p.add_argument("--prompts", help="jsonl with 'prompt' and optional 'category'")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--dtype", help="float32, bfloat16 or float16 (default: the preset's)")
    p.add_argument(
        "--prompt-lookup", action="store_true", help="Tandem runs copy recurring text first"
    )
    p.add_argument("--adaptive-draft", action="store_true", help="Tandem runs choose block lengths")
    p.add_argument(
        "--serve-config", help="--mode service: a TandemConfig YAML for the service it starts"
    )
    p.add_argument("--repeats", type=int, default=3, help="median of this many (at least 3)")
    p.add_argument("--json", dest="json_out", help="write the result here")
    p.add_argument("--plot", help="write the chart here (PNG)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from cluster.cli.output import write_result
    from cluster.tools.bench import run_bench
    from cluster.tools.bench_report import format_table, plot
    from verifier.runtime.errors import InvalidArgumentError

    if args.repeats < 3:
        raise InvalidArgumentError(
            f"--repeats must be >= 3 (medians of repeats), got {args.repeats}"
        )
    if args.serve_config and args.mode != "service":
        raise InvalidArgumentError("--serve-config needs --mode service")
    if args.max_tokens < 1 or args.draft_tokens < 1:
        raise InvalidArgumentError("--max-tokens and --draft-tokens must be >= 1")
    started = time.monotonic()

    def progress(message: str) -> None:
        print(f"[{time.monotonic() - started:7.1f}s] {message}", file=sys.stderr, flush=True)

    result = run_bench(args, progress)
    write_result(result, args.json_out, args.plot, plot, format_table)
    return 0
