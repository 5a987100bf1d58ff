"""`tandem demo --address HOST:PORT [PROMPT]`: see `cluster.tools.demo`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

DEFAULT_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
DEFAULT_MAX_TOKENS = 64


def add_to(commands: Any) -> None:
    p = commands.add_parser(
        "demo", help="stream a prompt with speculation, then compare with the target alone"
    )
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT, help="default: a code prompt")
    p.add_argument("--address", required=True, metavar="HOST:PORT", help="a Tandem server")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from cluster.api.client import TandemClient
    from cluster.serve import local_cluster
    from cluster.tools.demo import format_report, run_demo

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    write(args.prompt)
    with TandemClient(args.address, api_key=local_cluster.api_key()) as client:
        report = run_demo(client, args.prompt, args.max_tokens, write)
    print("\n")
    print(format_report(report), flush=True)
    return 0
