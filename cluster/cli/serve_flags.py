"""The flags of `tandem serve` and the `TandemConfig` they make.

`add_serve_flags(parser)` adds them to the `serve` subcommand's parser; `config_from_flags(args)`
reads the config file (`--config`, else the defaults) and changes only what a flag gives:
replica counts, the draft's quantization and vocabulary, the router's features (prompt lookup,
the suffix drafter, the adaptive plan), the stream interval, and the two doors' ports
(`cluster.cli.doors`). The routers serve this machine only (`loopback.LOOPBACK`). Pure:
no cluster is joined and no port is probed; `cluster.config` is imported inside, so that
commands that never serve do not wait for torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from cluster.cli.doors import port_number, proxy_grpc_port
from cluster.runtime.model_spec import QUANTIZATIONS
from cluster.serve import loopback

if TYPE_CHECKING:
    from cluster.config import TandemConfig

DEFAULT_NUM_CPUS = 8
"""Logical CPUs the local cluster advertises (replicas reserve none by default)."""


def add_serve_flags(serve: argparse.ArgumentParser) -> None:
    """The flags of `tandem serve`, on its subcommand's parser."""
    serve.add_argument("--preset", help="model pair (default: tiny)")
    serve.add_argument("--config", help="YAML file with a TandemConfig")
    serve.add_argument("--drafters", type=int, help="drafter replicas")
    serve.add_argument("--verifiers", type=int, help="verifier replicas")
    serve.add_argument(
        "--port",
        type=port_number,
        metavar="PORT",
        help="gRPC port of the public API, served by the router replicas themselves "
        "(default 9000, or the config's front.grpc_port)",
    )
    serve.add_argument(
        "--http-port",
        type=port_number,
        metavar="PORT",
        help="port of the OpenAI-compatible HTTP API, served by the router replicas "
        "themselves (default 8000, or the config's front.http_port)",
    )
    serve.add_argument(
        "--proxy-port",
        type=port_number,
        metavar="PORT",
        help="gRPC port of Serve's proxy, the same API through Serve: the second door "
        "(default: --port + 1, or the config's proxy_grpc_port)",
    )
    serve.add_argument(
        "--proxy-http-port",
        type=port_number,
        metavar="PORT",
        help="port of Serve's HTTP proxy, the same OpenAI-compatible API through Serve: the "
        "second door (default: the HTTP port + 1)",
    )
    serve.add_argument(
        "--prompt-lookup",
        action=argparse.BooleanOptionalAction,
        help="copy recurring text before drafting (default: the config's, on)",
    )
    serve.add_argument(
        "--suffix-drafter",
        action=argparse.BooleanOptionalAction,
        help="draft from the tenant's earlier text on CPU-only replicas before the model "
        "(default: the config's, on)",
    )
    serve.add_argument("--suffix-drafters", type=int, help="suffix drafter replicas")
    serve.add_argument(
        "--adaptive-draft",
        action=argparse.BooleanOptionalAction,
        help="choose each round's length and pipelining per request (default: the config's, on)",
    )
    serve.add_argument(
        "--stream-interval-tokens",
        type=int,
        metavar="N",
        help="let a stream's chunks out once N tokens have gathered; the first and last at "
        "once (default: the config's, 0: every verifier step's)",
    )
    serve.add_argument(
        "--stream-interval-ms",
        type=float,
        metavar="MS",
        help="let a stream's chunks out once MS milliseconds have passed since the last "
        "(default: the config's, 0: none)",
    )
    serve.add_argument(
        "--draft-quantization",
        choices=QUANTIZATIONS,
        help="the draft model's weights (default: the config's, else the preset's)",
    )
    serve.add_argument(
        "--draft-vocab",
        type=int,
        metavar="N",
        help="the draft scores only the N most frequent token ids, 0 all of them "
        "(default: the config's, else the preset's)",
    )
    serve.add_argument("--num-cpus", type=int, default=DEFAULT_NUM_CPUS, help="for a new cluster")
    serve.add_argument("--detach", action="store_true", help="return once the service is up")


def config_from_flags(args: argparse.Namespace) -> TandemConfig:
    """The config `tandem serve` deploys: the file's (or the defaults), as the flags change it."""
    # Imported here: it pulls in torch, which `tandem generate --address` must not wait for.
    from cluster.config import FrontConfig, TandemConfig

    config = TandemConfig.from_yaml(args.config) if args.config else TandemConfig()
    changes: dict[str, Any] = {}
    if args.preset:
        changes["models"] = dataclasses.replace(config.models, preset=args.preset)
    drafter = config.drafter
    if args.drafters is not None:
        drafter = dataclasses.replace(drafter, num_replicas=args.drafters)
    if args.draft_quantization is not None:
        drafter = dataclasses.replace(drafter, quantization=args.draft_quantization)
    if args.draft_vocab is not None:
        drafter = dataclasses.replace(drafter, trimmed_vocab=args.draft_vocab)
    if drafter is not config.drafter:
        changes["drafter"] = drafter
    if args.verifiers is not None:
        changes["verifier"] = dataclasses.replace(config.verifier, num_replicas=args.verifiers)
    changes["front"] = FrontConfig(
        grpc_port=_given(args.port, config.front.grpc_port),
        http_port=_given(args.http_port, config.front.http_port),
        host=loopback.LOOPBACK,
    )
    changes["proxy_grpc_port"] = proxy_grpc_port(args, config, changes["front"])
    if args.prompt_lookup is not None:
        changes["prompt_lookup"] = dataclasses.replace(
            config.prompt_lookup, enabled=args.prompt_lookup
        )
    if args.suffix_drafter is not None:
        changes["suffix_drafter"] = dataclasses.replace(
            config.suffix_drafter, enabled=args.suffix_drafter
        )
    if args.suffix_drafters is not None:
        changes["suffix"] = dataclasses.replace(config.suffix, num_replicas=args.suffix_drafters)
    if args.adaptive_draft is not None:
        changes["draft_length"] = dataclasses.replace(
            config.draft_length, enabled=args.adaptive_draft
        )
    interval = {
        name: value
        for name, value in (
            ("stream_interval_tokens", args.stream_interval_tokens),
            ("stream_interval_ms", args.stream_interval_ms),
        )
        if value is not None
    }
    if interval:
        changes["api"] = dataclasses.replace(config.api, **interval)
    return dataclasses.replace(config, **changes)


def _given(flag: int | None, configured: int | None) -> int | None:
    return configured if flag is None else flag
