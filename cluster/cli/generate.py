"""`tandem generate`: one prompt, run in this process (`--local`) or by a server (`--address`).

Both modes build the same `GenerateRequest` (`cluster.api.client_types.build_request`) and run it
through the public API's code: `--local` hands it to a `TandemService` over an in-process
router, `--address HOST:PORT` sends it to a server with `TandemClient`. So the same flags give
the same tokens, the same JSON keys (`JSON_KEYS`) and the same error messages either way.
`--json` prints one object when the generation ends; without it, text is written to stdout as
it is committed. `--chat` sends the prompt as one user message (the request's `chat` prompt),
which the server renders with the target model's chat template, as an instruct model expects.

`--preset`, `--target`, `--draft`, `--dtype` and `--device` pick the models, and
`--prompt-lookup` and `--adaptive-draft` set up its router, so they belong to `--local`: a server
has picked its own, and giving one with `--address` is an error. They default to None so
that "given" can be told from "left alone"; names and values are checked by `cluster.presets`
/ `cluster.runtime.models` when the models are loaded. Unset `--seed`,
`--draft-tokens` and `--pipelined` leave the request field unset, meaning the service's default.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from cluster.api.client import TandemClient
from cluster.api.client_types import (
    GenerateResult,
    StreamChunk,
    build_request,
    chunk_from_proto,
    result_from_response,
)
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.grammar import JSON_OBJECT, JSON_SCHEMA, LARK, REGEX, Grammar
from cluster.serve import ray_cluster
from protos import generate_pb2

JSON_KEYS = (
    "tokens",
    "text",
    "finish_reason",
    "num_prompt_tokens",
    "num_generated_tokens",
    "num_drafted",
    "num_accepted",
    "num_verify_passes",
    "acceptance_rate",
    "pipeline_hits",
    "pipeline_misses",
    "request_id",
)
"""The keys of `--json` output, in order; `acceptance_rate` is null when nothing was drafted."""

MODEL_FLAGS = ("preset", "target", "draft", "dtype", "device", "prompt_lookup", "adaptive_draft")
"""Flags that build the in-process service (models, prompt lookup): `--local` only."""


def add_to(commands: Any) -> None:
    """Add the `generate` subcommand to the `argparse` subparsers `commands`."""
    p = commands.add_parser("generate", help="generate text for a prompt")
    p.add_argument("prompt", help="the prompt text (with --chat: the user's message)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as one user message, rendered by the model's chat template",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", action="store_true", help="run drafter and verifier in-process")
    where.add_argument("--address", metavar="HOST:PORT", help="a Tandem server's gRPC address")
    models = p.add_argument_group("models (--local only: a server has its own)")
    models.add_argument("--preset", help="named target/draft pair (default: tiny)")
    models.add_argument("--target", help="target model: hub id, folder or .gguf")
    models.add_argument("--draft", help="draft model: hub id, folder or .gguf")
    models.add_argument("--dtype", help="float32, bfloat16 or float16 (default: preset's)")
    models.add_argument("--device", help="auto, cpu, cuda or cuda:N (default: auto)")
    models.add_argument(
        "--prompt-lookup",
        action="store_true",
        default=None,
        help="copy recurring text before drafting (the router's prompt lookup)",
    )
    models.add_argument(
        "--adaptive-draft",
        action="store_true",
        default=None,
        help="choose each block's length from acceptance and latency (up to --draft-tokens)",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    p.add_argument(
        "--seed",
        type=int,
        help="sampling seed (default: a fresh random one); a seeded request follows the "
        "seed-exact rule unless --sampling-rule says otherwise",
    )
    p.add_argument(
        "--sampling-rule",
        choices=("auto", "seed_exact", "rejection"),
        default="auto",
        help="seed_exact: the output depends only on the seed and settings, whatever drafted "
        "it; rejection: accepts more drafts (default auto: seed_exact when --seed is given)",
    )
    p.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    p.add_argument(
        "--stop-token-id", type=int, action="append", default=[], dest="stop_token_ids",
        help="a token id that ends the output like end-of-sequence (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--min-tokens", type=int, default=0, help="end tokens are forbidden before this many"
    )
    p.add_argument("--ignore-eos", action="store_true", help="generate past end-of-sequence tokens")
    p.add_argument(
        "--keep-special-tokens", action="store_true",
        help="keep special tokens (end-of-sequence...) in the text",
    )  # fmt: skip
    constraint = p.add_argument_group(
        "structured output (one at most; docs/structured-outputs.md)"
    ).add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema", metavar="SCHEMA", help="a JSON schema: its text, or @FILE to read it"
    )
    constraint.add_argument("--json-object", action="store_true", help="any JSON object")
    constraint.add_argument("--regex", help="a regular expression the output matches")
    constraint.add_argument(
        "--grammar", metavar="LARK", help="a Lark grammar (start rule `start`), or @FILE"
    )
    p.add_argument("--draft-tokens", type=int, help="draft block length; 0 = the target alone")
    p.add_argument(
        "--pipelined",
        action=argparse.BooleanOptionalAction,
        help="draft the next block while one is verified (default: the service's)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object with the result")
    p.set_defaults(handler=run)


def result_json(result: GenerateResult) -> dict[str, object]:
    values: dict[str, object] = {
        "tokens": list(result.tokens),
        "text": result.text,
        "finish_reason": result.finish_reason,
        "num_prompt_tokens": result.num_prompt_tokens,
        "num_generated_tokens": result.num_generated_tokens,
        "num_drafted": result.num_drafted,
        "num_accepted": result.num_accepted,
        "num_verify_passes": result.num_verify_passes,
        "acceptance_rate": result.acceptance_rate,
        "pipeline_hits": result.pipeline_hits,
        "pipeline_misses": result.pipeline_misses,
        "request_id": result.request_id,
    }
    return {key: values[key] for key in JSON_KEYS}


def run(args: argparse.Namespace) -> int:
    if args.address is not None:
        given = [
            f"--{name.replace('_', '-')}" for name in MODEL_FLAGS if getattr(args, name) is not None
        ]
        if given:
            raise InvalidArgumentError(
                f"{', '.join(given)} cannot be used with --address: the server picks its models"
            )
    request = build_request(
        None if args.chat else args.prompt,
        messages=[{"role": "user", "content": args.prompt}] if args.chat else None,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        draft_tokens=args.draft_tokens,
        pipelined=args.pipelined,
        sampling_rule=args.sampling_rule,
        min_tokens=args.min_tokens,
        stop_token_ids=args.stop_token_ids,
        ignore_eos=args.ignore_eos,
        skip_special_tokens=not args.keep_special_tokens,
        grammar=_grammar(args),
    )
    if args.address is not None:
        with TandemClient(args.address, api_key=ray_cluster.api_key()) as client:
            return _output(
                args.json,
                lambda: client.generate_request(request),
                lambda: client.stream_request(request),
            )
    return _run_local(args, request)


def _grammar(args: argparse.Namespace) -> Grammar | None:
    """The grammar the flags ask for; a value `@FILE` is read from FILE."""

    def text(value: str) -> str:
        if not value.startswith("@"):
            return value
        try:
            return Path(value[1:]).read_text()
        except OSError as error:
            raise InvalidArgumentError(f"cannot read {value[1:]}: {error}") from None

    if args.json_object:
        return Grammar(JSON_OBJECT)
    for kind, value in ((JSON_SCHEMA, args.json_schema), (REGEX, args.regex),
                        (LARK, args.grammar)):  # fmt: skip
        if value is not None:
            return Grammar(kind, text(value))
    return None


def _run_local(args: argparse.Namespace, request: generate_pb2.GenerateRequest) -> int:
    # Loading torch and transformers takes seconds: only here, never for --address.
    from cluster.api.grpc_api import GrpcApi
    from cluster.api.service import TandemService
    from cluster.api.tenants import Tenants
    from cluster.local import build_local
    from cluster.presets import DEFAULT_PRESET, resolve_pair
    from cluster.routing.draft_length_config import DraftLengthConfig
    from drafter.config import NgramConfig

    preset = args.preset if args.preset is not None else DEFAULT_PRESET
    pair = resolve_pair(preset, args.target, args.draft, args.dtype, args.device)
    tandem = build_local(
        pair,
        prompt_lookup=NgramConfig(enabled=bool(args.prompt_lookup)),
        draft_length=DraftLengthConfig(enabled=bool(args.adaptive_draft)),
    )
    # In-process: this process owns the models and listens on nothing, so no one else can call.
    # The messages the remote client would send, through the gRPC face's adapter.
    service = GrpcApi(
        TandemService(
            tandem.router,
            tandem.tokenizer,
            tenants=Tenants.unauthenticated(),
            max_context_tokens=tandem.verifier.config.max_context_tokens,
        )
    )
    try:
        return _output(
            args.json,
            lambda: result_from_response(service.generate(request)),
            lambda: (chunk_from_proto(chunk) for chunk in service.stream(request)),
        )
    finally:
        tandem.router.close()


def _output(
    as_json: bool,
    generate: Callable[[], GenerateResult],
    stream: Callable[[], Iterable[StreamChunk]],
) -> int:
    if as_json:
        print(json.dumps(result_json(generate())))
        return 0
    wrote = finished = False
    try:
        for chunk in stream():
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            wrote = wrote or chunk.text != ""
        finished = True
    finally:
        # End the line, but print nothing at all for a request that failed before any text.
        if wrote or finished:
            sys.stdout.write("\n")
    return 0
