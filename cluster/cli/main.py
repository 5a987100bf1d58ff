"""The `tandem` command line.

Each subcommand lives in its own module with an `add_to(subparsers)` function that adds its
parser and sets `handler` (a function of the parsed arguments returning the exit status) with
`set_defaults(handler=...)`; `REGISTRARS` lists them. Subcommand modules import heavy
dependencies (torch, transformers, Ray) inside their handlers, so that `tandem generate
--address` starts in a fraction of a second.

Flags are parsed and validated once, here, at the edge. A failure ends with one line on stderr,
never a traceback: `tandem: error: <CODE>: <message>`, where CODE is the error's gRPC status
name, whether a server sent it or it was raised in this process (a misused flag is
INVALID_ARGUMENT; argparse's own usage errors keep argparse's format). Exit status 2 means the
input was wrong (retrying will not help); 1 means the service failed (unavailable, past a
deadline, internal, busy).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from cluster.api.client_types import TandemClientError
from cluster.cli import audit as cli_audit
from cluster.cli import bench as cli_bench
from cluster.cli import config as cli_config
from cluster.cli import demo as cli_demo
from cluster.cli import generate as cli_generate
from cluster.cli import keys as cli_keys
from cluster.cli import loadtest as cli_loadtest
from cluster.cli import models as cli_models
from cluster.cli import plan as cli_plan
from cluster.cli import service as cli_service
from cluster.cli import soak as cli_soak
from cluster.runtime.errors import TandemError

EXIT_USAGE = 2
EXIT_FAILURE = 1

FAILURE_CODES = frozenset(
    {
        "ABORTED",
        "CANCELLED",
        "DATA_LOSS",
        "DEADLINE_EXCEEDED",
        "INTERNAL",
        "RESOURCE_EXHAUSTED",
        "UNAVAILABLE",
        "UNKNOWN",
    }
)
"""gRPC status names that mean the service failed, not the input: exit status 1."""

Registrar = Callable[[Any], None]
"""Adds one subcommand to the `argparse` subparsers object it is given."""

REGISTRARS: tuple[Registrar, ...] = (
    cli_generate.add_to,
    cli_service.add_to,
    cli_models.add_to,
    cli_bench.add_to,
    cli_demo.add_to,
    cli_loadtest.add_to,
    cli_soak.add_to,
    cli_keys.add_to,
    cli_config.add_to,
    cli_audit.add_to,
    cli_plan.add_to,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="Disaggregated speculative decoding."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_to in REGISTRARS:
        add_to(commands)
    return parser


def _fail(code: str, message: str) -> int:
    print(f"tandem: error: {code}: {message}", file=sys.stderr)
    return EXIT_FAILURE if code in FAILURE_CODES else EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except TandemClientError as error:
        return _fail(error.code.name, error.message)
    except TandemError as error:
        return _fail(error.status, str(error))
    except KeyboardInterrupt:
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
