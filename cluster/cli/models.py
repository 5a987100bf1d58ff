"""`tandem models fetch NAME` and `tandem models list`: model packs in the local cache."""

from __future__ import annotations

import argparse
from typing import Any


def add_to(commands: Any) -> None:
    models = commands.add_parser("models", help="fetch and list model packs")
    actions = models.add_subparsers(dest="action", required=True, metavar="ACTION")
    fetch = actions.add_parser("fetch", help="download, check and convert a model pack")
    fetch.add_argument("name", help="pack name, e.g. qwen-coder")
    fetch.set_defaults(handler=fetch_command)
    listing = actions.add_parser("list", help="packs and what is cached")
    listing.set_defaults(handler=list_command)


def fetch_command(args: argparse.Namespace) -> int:
    from cluster.runtime.errors import InvalidArgumentError
    from cluster.runtime.pack_catalog import PACKS
    from cluster.runtime.packs import fetch
    from cluster.runtime.progress import Progress

    if args.name not in PACKS:
        raise InvalidArgumentError(
            f"unknown model pack {args.name!r}; known packs: {', '.join(sorted(PACKS))}"
        )
    # Bars on a terminal, plain timestamped lines in logs and docker builds.
    for name, folder in fetch(PACKS[args.name], Progress()).items():
        print(f"{name}\t{folder}")
    return 0


def list_command(args: argparse.Namespace) -> int:
    from cluster.runtime.pack_catalog import PACK_DTYPES, PACKS, cache_root, model_dir
    from cluster.runtime.packs import is_converted

    print(f"model cache: {cache_root()}")
    for pack in PACKS.values():
        for model in pack.models:
            ready = [d for d in PACK_DTYPES if is_converted(model_dir(pack, model.role, d))]
            state = ", ".join(ready) if ready else "not fetched"
            print(f"{pack.name:<12} {model.role:<7} {model.name:<45} {state}")
    return 0
