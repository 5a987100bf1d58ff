"""`tandem loadtest`: concurrent streaming load against a running service (see
`cluster.tools.bench.loadtest`), level by level.

`--concurrency` takes one level or several; `--compare` runs every level twice, with the
service's speculation and with the target alone (draft length 0), alternating, and reports the
speedup of speculation at each level: the "never slower under load" check. `--plot` draws
aggregate tokens/s and that speedup against concurrency. `--predraft` runs three speculative
modes at every level: `speculative` pipelining without pre-drafting, `serial` rounds, and
`predrafted` (outcome-keyed pre-drafting up to the widest fan-out, the adaptive plan's budget
choosing each round's, `cluster.routing.predraft_budget`), each beside its ideal with a sim
preset. `--kill drafter|verifier` kills a replica half way through each speculative run.

`--compare --hf-baseline` adds `hf_target_batched` at every level: Hugging Face serving the
target alone at the same concurrency, in this process (`cluster.tools.baselines.hf_baseline`),
after the service's runs of the level, so the two never share the CPU. It loads the target the
service's verifier runs, in its dtype, with every core of the machine: the single batched server
one would run instead (`cluster.tools.baselines.hf_levels.service_target`: `--preset`, else the
model the service reports when `tandem serve` started it here; `--serve-config` for the rest),
and runs greedy (`--temperature 0`). `hf_baseline` in the JSON says which method ran and why.

`--preset NAME` says which pair the service runs (loadtest cannot always ask it). A simulated
preset (`sim-...`, `cluster.runtime.sim`) adds the analytic ideal of every level and mode
(`cluster.tools.bench.loadtest_ideal`: speculative, the better of serial and pipelined rounds, at
the draft's alpha and `--draft-tokens`, else the service's default; target-only; at the mean
prompt length in the preset's tokens plus half of `--max-tokens`); `sim` in the JSON says what
it was computed from. A simulated model has no device speed outside the service, so
`--hf-baseline` refuses a sim preset; when the service `tandem serve` started here reports
another preset, the run refuses to start. Here: the flags, their checks, what a run loads before
the load; the levels run in `cluster.cli.loadtest_levels`, the result reads in
`cluster.cli.loadtest_report`.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import TYPE_CHECKING, Any

from cluster.cli.loadtest_levels import run_levels, say
from cluster.cli.loadtest_report import HF_MODE, format_table, plot
from cluster.runtime.errors import InvalidArgumentError

if TYPE_CHECKING:
    from cluster.tools.baselines.hf_levels import HFLevels
    from cluster.tools.bench.loadtest_ideal import SimIdeal

MAX_CONCURRENCY = 256
MAX_DURATION_S = 3600.0


def add_to(commands: Any) -> None:
    p = commands.add_parser("loadtest", help="concurrent streams against a running service")
    p.add_argument("--address", default="127.0.0.1:9000", metavar="HOST:PORT")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8], help="one or more levels")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load per level")
    p.add_argument(
        "--connections",
        type=int,
        default=1,
        help="TCP connections the load spreads its streams over (the routers' own servers "
        "split a port's connections between the router replicas of a node)",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--draft-tokens", type=int, help="default: the service's")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 is greedy (default); > 0 samples"
    )
    p.add_argument("--compare", action="store_true", help="also run the target alone")
    p.add_argument(
        "--predraft",
        action="store_true",
        help="also run serial rounds and outcome-keyed pre-drafting (the plan's budget picks "
        "the fan-out, up to the widest); speculative then pipelines without pre-drafting",
    )
    p.add_argument(
        "--kill",
        choices=("drafter", "verifier"),
        help="kill a replica of this side half way through each speculative run",
    )
    p.add_argument("--prompts", help="jsonl as for tandem bench (default: its prompt set)")
    p.add_argument("--json", dest="json_out", help="write the result here")
    p.add_argument("--plot", help="--compare: write tokens/s and speedup by concurrency (PNG)")
    p.add_argument(
        "--preset",
        help="the pair the service runs: a sim preset adds the ideal of every level; "
        "for --hf-baseline, default: the one the service reports",
    )
    hf = p.add_argument_group("Hugging Face baseline (--compare --hf-baseline)")
    hf.add_argument(
        "--hf-baseline",
        action="store_true",
        help=f"also run {HF_MODE}: the target alone, batched, in this process",
    )
    hf.add_argument(
        "--hf-method",
        choices=("auto", "generate", "generate_batch"),
        default="auto",
        help="auto: the faster in a short probe of both",
    )
    hf.add_argument(
        "--serve-config",
        help="the TandemConfig YAML the service was started with "
        "(its models and its verifier's threads)",
    )
    hf.add_argument("--hf-threads", type=int,
                    help="torch threads (default: every core of this machine)")  # fmt: skip
    p.set_defaults(handler=run)


def _check(args: argparse.Namespace) -> None:
    from cluster.presets import PRESETS
    from cluster.tools.bench.sim import is_sim_preset

    if not all(1 <= c <= MAX_CONCURRENCY for c in args.concurrency):
        raise InvalidArgumentError(f"--concurrency must be in 1..{MAX_CONCURRENCY}")
    if args.connections < 1:
        raise InvalidArgumentError("--connections must be >= 1")
    if not 0 < args.duration <= MAX_DURATION_S:
        raise InvalidArgumentError(f"--duration must be in (0, {MAX_DURATION_S:.0f}] seconds")
    if args.max_tokens < 1:
        raise InvalidArgumentError("--max-tokens must be >= 1")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise InvalidArgumentError("--temperature must be a finite number >= 0")
    if args.preset is not None and args.preset not in PRESETS:
        raise InvalidArgumentError(
            f"unknown preset {args.preset!r}; known presets: {', '.join(sorted(PRESETS))}"
        )
    if args.hf_baseline and args.preset is not None and is_sim_preset(args.preset):
        raise InvalidArgumentError(
            f"--hf-baseline does not apply to the simulated preset {args.preset}: its model has "
            "no device speed under Hugging Face generate (the ideal per level is its reference)"
        )
    if args.plot and not args.compare:
        raise InvalidArgumentError("--plot needs --compare")
    if args.plot:
        from cluster.tools.bench.output import pyplot

        pyplot()  # installed, before the run rather than after it
    if args.hf_baseline and not args.compare:
        raise InvalidArgumentError("--hf-baseline needs --compare")
    if args.hf_baseline and args.temperature != 0:
        raise InvalidArgumentError("--hf-baseline measures greedy decoding: use --temperature 0")
    hf_flags = {"--serve-config": args.serve_config,
                "--hf-threads": args.hf_threads,
                "--hf-method": None if args.hf_method == "auto" else args.hf_method}  # fmt: skip
    given = [flag for flag, value in hf_flags.items() if value is not None]
    if given and not args.hf_baseline:
        raise InvalidArgumentError(f"{', '.join(given)} needs --hf-baseline")
    if args.hf_threads is not None and args.hf_threads < 1:
        raise InvalidArgumentError("--hf-threads must be >= 1")


def run(args: argparse.Namespace) -> int:
    from cluster.cli.output import write_result
    from cluster.tools.prompt_files import load_prompts

    _check(args)
    prompts = [p.text for p in load_prompts(args.prompts)]
    started = time.monotonic()
    sim = _sim_ideal(args, prompts)
    hf = _load_baseline(args, prompts, started) if args.hf_baseline else None
    try:
        result = run_levels(args, prompts, started, hf, sim)
    finally:  # Ctrl-C too: free the baseline's model
        if hf is not None:
            hf.close()
    write_result(result, args.json_out, args.plot, plot, format_table)
    return 0


def _sim_ideal(args: argparse.Namespace, prompts: list[str]) -> SimIdeal | None:
    """What the ideal of every level needs, when `--preset` names a simulated pair: its sources,
    the block length requests draft, and the prompts' lengths in its tokens."""
    from cluster.presets import resolve_pair
    from cluster.routing.draft_length_config import DEFAULT_DRAFT_TOKENS
    from cluster.runtime.models import load_tokenizer
    from cluster.tools.baselines.hf_levels import reported_model
    from cluster.tools.bench.loadtest_ideal import SimIdeal
    from cluster.tools.bench.sim import is_sim_preset

    if args.preset is None or not is_sim_preset(args.preset):
        return None
    pair = resolve_pair(args.preset)
    reported = reported_model(args.address)
    if reported is not None and reported not in (args.preset, pair.target.source):
        raise InvalidArgumentError(
            f"the service serves {reported!r}, not the preset {args.preset!r}: "
            "give the --preset it was started with"
        )
    tokenizer = load_tokenizer(pair.target).tokenizer
    lengths = [len(tokenizer.encode(text, add_special_tokens=False)) for text in prompts]
    k = DEFAULT_DRAFT_TOKENS if args.draft_tokens is None else args.draft_tokens
    return SimIdeal.from_sources(args.preset, pair.target.source, pair.draft.source, k, lengths,
                                 args.max_tokens)  # fmt: skip


def _load_baseline(args: argparse.Namespace, prompts: list[str], started: float) -> HFLevels:
    """Find the target the service's verifier runs (`service_target`) and load it here."""
    from cluster.tools.baselines.hf_levels import HFLevels, reported_model, service_target

    spec, threads = service_target(args.preset, args.serve_config, reported_model(args.address))
    return HFLevels(spec, args.hf_threads or threads, args.hf_method, prompts, args.concurrency,
                    args.duration, args.max_tokens, lambda text: say(started, text))  # fmt: skip
