"""The `tandem` command line.

`tandem generate --local ...` runs the whole speculative loop in this process. Flags are parsed
and validated once, here, at the edge; bad input ends with a one-line message on stderr and
exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from cluster.presets import DEFAULT_PRESET, PRESETS, resolve_pair
from cluster.request import DEFAULT_DRAFT_TOKENS, GenerationRequest, GenerationResult
from verifier.errors import TandemError
from verifier.models import DTYPES
from verifier.sampling import SamplingParams

EXIT_USAGE = 2
EXIT_FAILURE = 1


def _add_generate(commands: Any) -> None:
    p = commands.add_parser("generate", help="generate text for a prompt")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--local", action="store_true", help="run drafter and verifier in-process")
    p.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS))
    p.add_argument("--target", help="target model: hub id, folder or .gguf (overrides preset)")
    p.add_argument("--draft", help="draft model: hub id, folder or .gguf (overrides preset)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="weight dtype (default: preset's)")
    p.add_argument("--device", help="auto, cpu, cuda or cuda:N (default: auto)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = no limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    p.add_argument(
        "--draft-tokens",
        type=int,
        default=DEFAULT_DRAFT_TOKENS,
        help="draft block length; 0 = the target alone",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object with the result")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="Disaggregated speculative decoding."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(commands)
    return parser


def result_json(result: GenerationResult) -> dict[str, Any]:
    stats = result.stats
    return {
        "tokens": list(result.tokens),
        "text": result.text,
        "finish_reason": result.finish_reason.value,
        "num_prompt_tokens": result.num_prompt_tokens,
        "num_generated_tokens": len(result.tokens),
        "num_drafted": stats.num_drafted,
        "num_accepted": stats.num_accepted,
        "num_verify_passes": stats.num_verify_passes,
        "acceptance_rate": None if stats.num_drafted == 0 else stats.acceptance_rate,
    }


def _generate(args: argparse.Namespace) -> int:
    if not args.local:
        raise TandemError("generate needs --local (run drafter and verifier in this process)")
    if args.prompt == "":
        raise TandemError("prompt must not be empty")
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    pair = resolve_pair(args.preset, args.target, args.draft, args.dtype, args.device)

    from cluster.local import build_local  # loads torch and transformers: only when needed

    tandem = build_local(pair)
    request = GenerationRequest(
        prompt_tokens=tuple(tandem.tokenizer.encode(args.prompt, add_special_tokens=False)),
        max_tokens=args.max_tokens,
        sampling=sampling,
        seed=args.seed,
        stop=tuple(args.stop),
        draft_tokens=args.draft_tokens,
    )
    if args.json:
        print(json.dumps(result_json(tandem.router.generate(request))))
        return 0
    for chunk in tandem.router.stream(request):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _generate(args)
    except TandemError as error:
        print(f"tandem: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
