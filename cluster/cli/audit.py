"""`tandem audit`: check a service's output against the plain target, token by token.

Each request is served (by a server with `--address HOST:PORT`, or by an in-process Tandem with
`--local`) and then replayed through the plain target loaded in this process: no drafter, no
batching, in `--dtype` (default float32). Greedy and seed-exact outputs are functions of
(prompt, seed, settings, target) alone, so every served token must be the target's own choice
(`verifier.reference`, `cluster.runtime.audit`). `--statistical` instead compares the first two
tokens of `--samples` unseeded (rejection-rule) requests with the target's exact distribution
by a chi-square test (`cluster.tools.audit.stats`).

The reference's flags (`--preset`, `--target`, `--dtype`, `--device`) work in both modes; those
that build the in-process service (`--draft`, `--service-dtype`, `--prompt-lookup`,
`--adaptive-draft`) are `--local` only. The in-process service speculates on every block
(`--draft-tokens`, the service's default length), first token included, with prompt lookup on:
the adaptive plan, which may turn drafting off where it does not pay (it rarely pays for the
tiny pair), is opt-in, so that the audit exercises the drafter and the acceptance rule rather
than the target alone. Progress goes to stderr, the table to stdout, every report to
`--json FILE`. Exit status 0 when everything
matched (or p >= `--alpha`), 1 otherwise (near-ties too, unless `--allow-near-ties`), 2 for
bad flags.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster.runtime.errors import InvalidArgumentError

if TYPE_CHECKING:  # torch and transformers load in the handler, not when the CLI starts
    from cluster.runtime.models import LoadedModel
    from cluster.runtime.sampling_params import SamplingParams
    from cluster.tools.audit.run import Generate

LOCAL_FLAGS = ("draft", "service_dtype", "prompt_lookup", "adaptive_draft")
"""Flags that build the in-process service: `--local` only."""


def add_to(commands: Any) -> None:
    """Add the `audit` subcommand to the `argparse` subparsers `commands`."""
    p = commands.add_parser(
        "audit", help="replay served requests through the plain target and compare the tokens"
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--address", metavar="HOST:PORT", help="a Tandem server's gRPC address")
    where.add_argument("--local", action="store_true", help="audit an in-process Tandem")
    p.add_argument("--prompts", metavar="FILE", help="one prompt per line, or a .jsonl file")
    p.add_argument(
        "--seeds", type=int, nargs="*", default=[1, 2, 3], help="seed-exact requests' seeds"
    )
    p.add_argument(
        "--greedy",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also send one greedy request per prompt (default: on)",
    )
    p.add_argument("--temperature", type=float, default=0.7, help="of the sampled requests")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--draft-tokens", type=int, help="draft block length (default: the service's)")
    ref = p.add_argument_group("the reference (the plain target, in this process)")
    ref.add_argument("--preset", help="named target/draft pair (default: tiny)")
    ref.add_argument("--target", help="target model: hub id, folder or .gguf")
    ref.add_argument("--dtype", default="float32", help="the replay's dtype (default: float32)")
    ref.add_argument("--device", default="cpu", help="auto, cpu, cuda or cuda:N (default: cpu)")
    local = p.add_argument_group("the in-process service (--local only)")
    local.add_argument("--draft", help="draft model: hub id, folder or .gguf")
    local.add_argument("--service-dtype", help="the service's dtype (default: the preset's)")
    local.add_argument(
        "--prompt-lookup", action=argparse.BooleanOptionalAction, help="(default: on)"
    )
    local.add_argument(
        "--adaptive-draft",
        action=argparse.BooleanOptionalAction,
        help="let the plan shorten blocks, down to none (default: off, so every block drafts)",
    )
    stat = p.add_argument_group("statistical mode (unseeded sampling)")
    stat.add_argument("--statistical", action="store_true", help="chi-square test of 2 tokens")
    stat.add_argument("--samples", type=int, default=1000, help="requests to sample")
    stat.add_argument("--prompt", help="the prompt (default: the first built-in prompt)")
    stat.add_argument("--alpha", type=float, default=1e-3, help="fail when p < alpha")
    p.add_argument("--allow-near-ties", action="store_true", help="exit 0 on near-ties")
    p.add_argument("--json", metavar="FILE", help="write every report here")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    _check_flags(args)
    from cluster.presets import DEFAULT_PRESET, resolve_pair
    from cluster.runtime.models import load_model

    preset = args.preset if args.preset is not None else DEFAULT_PRESET
    pair = resolve_pair(preset, args.target, args.draft, args.dtype, args.device)
    reference = load_model(pair.target)
    if args.address is not None:
        from cluster.api.client import TandemClient
        from cluster.serve import ray_cluster

        with TandemClient(args.address, api_key=ray_cluster.api_key()) as client:
            return _audit(args, reference, client.generate_request, "service")
    return _run_local(args, preset, reference)


def _check_flags(args: argparse.Namespace) -> None:
    if args.address is not None:
        given = [f"--{n.replace('_', '-')}" for n in LOCAL_FLAGS if getattr(args, n) is not None]
        if given:
            raise InvalidArgumentError(
                f"{', '.join(given)} cannot be used with --address: the server has its own"
            )
    if args.max_tokens < 1:
        raise InvalidArgumentError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.statistical and not 0 < args.alpha < 1:
        raise InvalidArgumentError(f"--alpha must be in (0, 1), got {args.alpha}")
    if not args.statistical and args.prompt is not None:
        raise InvalidArgumentError("--prompt is for --statistical; use --prompts FILE")
    if any(seed < 0 for seed in args.seeds):
        raise InvalidArgumentError(f"--seeds must be >= 0, got {args.seeds}")


def _run_local(args: argparse.Namespace, preset: str, reference: LoadedModel) -> int:
    from cluster.api.client_types import result_from_response
    from cluster.api.grpc_api import GrpcApi
    from cluster.api.service import TandemService
    from cluster.api.tenants import Tenants
    from cluster.local import build_local
    from cluster.presets import resolve_pair
    from cluster.routing.draft_length_config import DraftLengthConfig
    from drafter.config import NgramConfig

    pair = resolve_pair(preset, args.target, args.draft, args.service_dtype, args.device)
    lookup = args.prompt_lookup is not False
    tandem = build_local(
        pair,
        prompt_lookup=NgramConfig(enabled=lookup),
        draft_length=DraftLengthConfig(enabled=bool(args.adaptive_draft)),
        # One round at a time, the first waiting for the drafter: every position the audit
        # checks went through speculation, none is the verifier's own step.
        verifier_advances=False,
    )
    # The messages the remote client would send, through the gRPC face's adapter.
    service = GrpcApi(
        TandemService(
            tandem.router,
            tandem.tokenizer,
            tenants=Tenants.unauthenticated(),  # in-process: nothing listens, no one else calls
            max_context_tokens=tandem.verifier.config.max_context_tokens,
        )
    )
    drafter = "model+prompt_lookup" if lookup else "model"
    try:
        return _audit(args, reference, lambda r: result_from_response(service.generate(r)), drafter)
    finally:
        tandem.router.close()


def _audit(
    args: argparse.Namespace, reference: LoadedModel, generate: Generate, drafter: str
) -> int:
    from cluster.runtime.sampling_params import SamplingParams
    from cluster.tools.audit import run as audit_run

    sampled = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed_exact=True
    )
    if args.statistical:
        return _statistical(args, reference, generate, sampled)
    from cluster.runtime.audit import render_table, report_json, summarize, summary_json

    prompts = [audit_run.encode(reference, text) for text in audit_run.read_prompts(args.prompts)]
    cases = audit_run.plan_cases(prompts, args.seeds, sampled, args.greedy)
    reports = audit_run.audit_cases(
        cases,
        generate,
        reference,
        drafter,
        max_tokens=args.max_tokens,
        draft_tokens=args.draft_tokens,
        progress=_progress,
    )
    print(render_table(reports, [case.label for case in cases]))
    summary = summarize(reports)
    if args.json:
        rows = [
            {"label": c.label, "prompt": c.prompt_index, "seed": c.seed, **report_json(r)}
            for c, r in zip(cases, reports, strict=True)
        ]
        _write_json(
            args.json, {"mode": "tokens", "summary": summary_json(summary), "reports": rows}
        )
    failing = summary.requests - summary.by_cause["match"]
    if args.allow_near_ties:
        failing = summary.by_cause["divergence"]
    return 0 if failing == 0 else 1


def _statistical(
    args: argparse.Namespace, reference: LoadedModel, generate: Generate, sampled: SamplingParams
) -> int:
    from cluster.tools.audit import run as audit_run
    from cluster.tools.audit.stats import first_two_test

    text = args.prompt if args.prompt is not None else audit_run.read_prompts(args.prompts)[0]
    prompt = audit_run.encode(reference, text)
    samples = audit_run.sample_first_two(
        generate, prompt, sampled, args.samples, progress=_progress
    )
    test = first_two_test(reference, prompt, sampled, samples)
    passed = test.passed(args.alpha)
    print(
        f"chi-square over {test.num_samples} samples of the first two tokens, "
        f"{len(test.cells)} cells ({test.degrees_of_freedom} degrees of freedom): "
        f"statistic {test.statistic:.3f}, p = {test.p_value:.4g}"
        + (f", {test.impossible} impossible samples" if test.impossible else "")
    )
    print(f"{'pass' if passed else 'FAIL'} at alpha = {args.alpha:g}")
    if args.json:
        cells = [None if cell is None else list(cell) for cell in test.cells]
        _write_json(
            args.json,
            {
                "mode": "statistical",
                "p_value": test.p_value,
                "statistic": test.statistic,
                "degrees_of_freedom": test.degrees_of_freedom,
                "num_samples": test.num_samples,
                "impossible": test.impossible,
                "alpha": args.alpha,
                "passed": passed,
                "cells": cells,
                "observed": list(test.observed),
                "expected": list(test.expected),
            },
        )
    return 0 if passed else 1


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _write_json(path: str, value: dict[str, object]) -> None:
    try:
        Path(path).write_text(json.dumps(value, indent=2) + "\n")
    except OSError as error:
        raise InvalidArgumentError(f"cannot write {path}: {error}") from error
