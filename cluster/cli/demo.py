"""`tandem demo --address HOST:PORT [PROMPT]`: see `cluster.tools.demo`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

DEFAULT_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
DEFAULT_MAX_TOKENS = 64
EDIT_FILE = '''import json
from pathlib import Path


def load_settings(path):
    """Read the settings file, or return the defaults if it is missing."""
    file = Path(path)
    if not file.exists():
        return {"theme": "light", "font_size": 12, "autosave": True}
    with file.open() as handle:
        return json.load(handle)


def save_settings(path, settings):
    """Write the settings as indented JSON."""
    with Path(path).open("w") as handle:
        json.dump(settings, handle, indent=2)


def update_setting(path, key, value):
    """Set one setting and save the file; returns all of them."""
    settings = load_settings(path)
    settings[key] = value
    save_settings(path, settings)
    return settings
'''
EDIT_PROMPT = (
    f"# settings.py\n{EDIT_FILE}\n\n"
    "# settings.py again, whole, with the default font size changed from 12 to 14:\n"
    "import json\n"
)
"""The second case: a short real file re-sent with one change asked for, as a coding agent
does; most of the output repeats the prompt."""
EDIT_MAX_TOKENS = 96


def add_to(commands: Any) -> None:
    p = commands.add_parser(
        "demo", help="stream a prompt with speculation, then compare with the target alone"
    )
    p.add_argument(
        "prompt", nargs="?", default=None,
        help="default: two cases, a function to write and a file to edit",
    )  # fmt: skip
    p.add_argument("--address", required=True, metavar="HOST:PORT", help="a Tandem server")
    p.add_argument("--max-tokens", type=int, default=None, help="default: 64, the edit 96")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from cluster.api.client import TandemClient
    from cluster.serve import ray_cluster
    from cluster.tools.demo import format_report, run_demo

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    cases = [(args.prompt or DEFAULT_PROMPT, args.max_tokens or DEFAULT_MAX_TOKENS)]
    if args.prompt is None:
        cases.append((EDIT_PROMPT, args.max_tokens or EDIT_MAX_TOKENS))
    with TandemClient(args.address, api_key=ray_cluster.api_key()) as client:
        for number, (prompt, max_tokens) in enumerate(cases):
            if number:
                print("\nThe edit of a given file (most of the output repeats the prompt):\n")
            write(prompt)
            report = run_demo(client, prompt, max_tokens, write)
            print("\n")
            print(format_report(report), flush=True)
    ratio = _step_ratio_line()
    if ratio is not None:
        print(ratio.strip(), flush=True)
    return 0


def _step_ratio_line() -> str | None:
    """The measured draft-to-target step ratio of the local service, if this machine runs
    one (`tandem status` shows it too); None otherwise."""
    from cluster.cli.status_table import step_ratio_line
    from cluster.serve import ray_cluster

    try:
        return step_ratio_line(ray_cluster.live_replicas())
    except Exception:  # a remote or stopped service: the line is left out
        return None
