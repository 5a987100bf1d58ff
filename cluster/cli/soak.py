"""`tandem soak`: a long, mixed, faulty load on a service of its own, then a check that nothing
was lost, no greedy output changed and nothing leaked (see `cluster.tools.soak.run`).

The soak starts and stops its own service (the tiny pair, 2 drafters, 2 verifiers with small KV
pools, one drafter erring on purpose) in a private TANDEM_HOME on free ports, so it runs beside
a `tandem serve` of the user's. Exit status 1 when a must-be row of its table fails.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_to(commands: Any) -> None:
    from cluster.tools.soak.run import add_arguments

    p = commands.add_parser(
        "soak", help="a long faulty load on a service of its own, then a leak and loss check"
    )
    add_arguments(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from cluster.tools.soak.run import run_soak, settings_from

    return run_soak(settings_from(args), args.json_out)
