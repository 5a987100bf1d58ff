"""`tandem loadtest`: concurrent streaming load against a running service (see
`cluster.tools.loadtest`).

`--concurrency` takes one level or several; `--compare` runs every level twice, with the
service's speculation and with the target alone (draft length 0), alternating, and reports the
speedup of speculation at each level: the "never slower under load" check. `--plot` draws
aggregate tokens/s and that speedup against concurrency.

`--kill drafter|verifier` (the service `tandem serve` started here) SIGKILLs the replica of
that side holding the most sessions half way through each level's speculative run, and
reports `lost` (requests that started and did not complete) and, for greedy runs,
`corrupted` (completed outputs that differ from the target alone's, fetched once per prompt
before the load: exact for float32 models; in bfloat16 a near-tie can round differently in a
5-token verify pass than in a 1-token step). Replica memory (sessions, cached tokens, resident
MiB per side) is reported before the load and after it, once the sessions have drained.

`--compare --hf-baseline` adds `hf_target_batched` at every level: Hugging Face serving the
target alone at the same concurrency, in this process (`cluster.tools.hf_baseline`), after the
service's runs of the level, so the two never share the CPU. It loads the target the service's
verifier runs, in its dtype, with every core of the machine: the single batched server one would
run instead (`cluster.tools.hf_levels.service_target`: `--preset`, else the model the service
reports when `tandem serve` started it here; `--serve-config` for the rest), and runs greedy
(`--temperature 0`). `hf_baseline` in the JSON says which method ran and why. `goals` gives per
level speculative's tokens/s over target_only's and over hf_target_batched's, and speculative at
8 streams over 1 when both levels ran.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import TYPE_CHECKING, Any

from cluster.serve import local_cluster
from cluster.tools import faults
from verifier.runtime.errors import InvalidArgumentError

if TYPE_CHECKING:
    from cluster.tools.hf_levels import HFLevels

MAX_CONCURRENCY = 256
MAX_DURATION_S = 3600.0
HF_MODE = "hf_target_batched"


def add_to(commands: Any) -> None:
    p = commands.add_parser("loadtest", help="concurrent streams against a running service")
    p.add_argument("--address", default="127.0.0.1:9000", metavar="HOST:PORT")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8], help="one or more levels")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load per level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--draft-tokens", type=int, help="default: the service's")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 is greedy (default); > 0 samples"
    )
    p.add_argument("--compare", action="store_true", help="also run the target alone")
    p.add_argument(
        "--kill",
        choices=("drafter", "verifier"),
        help="kill a replica of this side half way through each speculative run",
    )
    p.add_argument("--prompts", help="jsonl as for tandem bench (default: its prompt set)")
    p.add_argument("--json", dest="json_out", help="write the result here")
    p.add_argument("--plot", help="--compare: write tokens/s and speedup by concurrency (PNG)")
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
    hf.add_argument("--preset", help="the pair the service runs (default: the one it reports)")
    hf.add_argument(
        "--serve-config",
        help="the TandemConfig YAML the service was started with "
        "(its models and its verifier's threads)",
    )
    hf.add_argument("--hf-threads", type=int,
                    help="torch threads (default: every core of this machine)")  # fmt: skip
    p.set_defaults(handler=run)


def _check(args: argparse.Namespace) -> None:
    if not all(1 <= c <= MAX_CONCURRENCY for c in args.concurrency):
        raise InvalidArgumentError(f"--concurrency must be in 1..{MAX_CONCURRENCY}")
    if not 0 < args.duration <= MAX_DURATION_S:
        raise InvalidArgumentError(f"--duration must be in (0, {MAX_DURATION_S:.0f}] seconds")
    if args.max_tokens < 1:
        raise InvalidArgumentError("--max-tokens must be >= 1")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise InvalidArgumentError("--temperature must be a finite number >= 0")
    if args.plot and not args.compare:
        raise InvalidArgumentError("--plot needs --compare")
    if args.hf_baseline and not args.compare:
        raise InvalidArgumentError("--hf-baseline needs --compare")
    if args.hf_baseline and args.temperature != 0:
        raise InvalidArgumentError("--hf-baseline measures greedy decoding: use --temperature 0")
    hf_flags = {"--preset": args.preset, "--serve-config": args.serve_config,
                "--hf-threads": args.hf_threads,
                "--hf-method": None if args.hf_method == "auto" else args.hf_method}  # fmt: skip
    given = [flag for flag, value in hf_flags.items() if value is not None]
    if given and not args.hf_baseline:
        raise InvalidArgumentError(f"{', '.join(given)} needs --hf-baseline")
    if args.hf_threads is not None and args.hf_threads < 1:
        raise InvalidArgumentError("--hf-threads must be >= 1")


def run(args: argparse.Namespace) -> int:
    from cluster.cli.output import write_result
    from cluster.tools.bench import load_prompts

    _check(args)
    prompts = [p.text for p in load_prompts(args.prompts)]
    started = time.monotonic()
    hf = _load_baseline(args, prompts, started) if args.hf_baseline else None
    try:
        result = _run(args, prompts, started, hf)
    finally:  # Ctrl-C too: free the baseline's model
        if hf is not None:
            hf.close()
    write_result(result, args.json_out, args.plot, plot, format_table)
    return 0


def _run(
    args: argparse.Namespace, prompts: list[str], started: float, hf: HFLevels | None
) -> dict[str, Any]:
    from cluster.api.client import TandemClient
    from cluster.tools import cleanup
    from cluster.tools.loadtest import run_load

    modes = {"speculative": args.draft_tokens}
    if args.compare:
        modes["target_only"] = 0
    levels: list[dict[str, Any]] = []
    replicas = _local_replicas(args.kill is not None)
    kills: list[dict[str, Any]] = []
    memory_before = faults.memory(replicas) if replicas is not None else None
    with TandemClient(args.address, timeout_s=600, api_key=local_cluster.api_key()) as client:
        reference = None
        if args.temperature == 0:
            reference = {
                p: client.generate(p, max_tokens=args.max_tokens, draft_tokens=0).tokens
                for p in prompts
            }
        for index, concurrency in enumerate(args.concurrency):
            level: dict[str, Any] = {"concurrency": concurrency}
            names = list(modes) if index % 2 == 0 else list(reversed(modes))
            for name in names:
                settings = {
                    "max_tokens": args.max_tokens,
                    "draft_tokens": modes[name],
                    "temperature": args.temperature,
                }
                midway = None
                if args.kill is not None and name == "speculative":
                    assert replicas is not None
                    midway = faults.kill_busiest(args.kill, replicas, kills)
                level[name] = run_load(
                    client, prompts, concurrency, args.duration, settings, midway, reference
                )
                print(f"[{time.monotonic() - started:7.1f}s] concurrency {concurrency} {name}: "
                      f"{level[name]['tokens_per_s']:.2f} tokens/s, "
                      f"{level[name]['requests']} requests, errors {level[name]['errors']}, "
                      f"lost {level[name]['lost']}, corrupted {level[name]['corrupted']}",
                      file=sys.stderr, flush=True)  # fmt: skip
            if hf is not None:  # after the service's runs: it is idle now
                # SIGTERM unwinds like Ctrl-C: the baseline's threads stop (`hf_baseline`).
                with cleanup.signals_raise():
                    level[HF_MODE] = hf.level(concurrency, reference)
                _say(started, f"concurrency {concurrency} {HF_MODE} ({hf.method}): "
                     f"{level[HF_MODE]['tokens_per_s']:.2f} tokens/s, "
                     f"{level[HF_MODE]['requests']} requests")  # fmt: skip
            if args.compare:
                level["speedup"] = (
                    level["speculative"]["tokens_per_s"] / level["target_only"]["tokens_per_s"]
                )
            levels.append(level)
    result = {
        "config": {"address": args.address, "duration_s": args.duration,
                   "max_tokens": args.max_tokens, "draft_tokens": args.draft_tokens,
                   "temperature": args.temperature, "kill": args.kill,
                   "prompts": args.prompts or "default"},
        "levels": levels,
        "lost": sum(lv[m]["lost"] for lv in levels for m in modes),
        "corrupted": None if reference is None
                     else sum(lv[m]["corrupted"] for lv in levels for m in modes),
        "killed": kills,
        "memory": {"before": memory_before,
                   "after": _drained_memory(replicas) if replicas is not None else None},
    }  # fmt: skip
    result["goals"] = goals(levels)
    if hf is not None:
        result["hf_baseline"] = hf.describe()
        result["config"].update(preset=args.preset, serve_config=args.serve_config)
    return result


def _say(started: float, message: str) -> None:
    print(f"[{time.monotonic() - started:7.1f}s] {message}", file=sys.stderr, flush=True)


def _load_baseline(args: argparse.Namespace, prompts: list[str], started: float) -> HFLevels:
    """Find the target the service's verifier runs (`service_target`) and load it here."""
    from cluster.tools.hf_levels import HFLevels, reported_model, service_target

    spec, threads = service_target(args.preset, args.serve_config, reported_model(args.address))
    return HFLevels(spec, args.hf_threads or threads, args.hf_method, prompts, args.concurrency,
                    args.duration, args.max_tokens, lambda text: _say(started, text))  # fmt: skip


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def goals(levels: list[dict[str, Any]]) -> dict[str, Any]:
    """Per level, speculative's tokens/s over target_only's and over hf_target_batched's; and
    speculative at 8 streams over speculative at 1, when both levels ran."""
    rate = {lv["concurrency"]: lv["speculative"]["tokens_per_s"] for lv in levels}
    per_level = []
    for level in levels:
        ratios: dict[str, Any] = {"concurrency": level["concurrency"]}
        for mode in ("target_only", HF_MODE):
            if mode in level:
                ratios[f"speculative_over_{mode}"] = _ratio(
                    level["speculative"]["tokens_per_s"], level[mode]["tokens_per_s"]
                )
        per_level.append(ratios)
    scaling = _ratio(rate[8], rate[1]) if 1 in rate and 8 in rate else None
    return {"speculative_8_over_1": scaling, "levels": per_level}


def _local_replicas(required: bool) -> faults.Replicas | None:
    """The live replicas of the service `tandem serve` started here, if there is one."""
    from cluster.serve import local_cluster

    if local_cluster.load_state() is None:
        if required:
            raise InvalidArgumentError("--kill needs the service tandem serve started here")
        return None
    return local_cluster.live_replicas


def _drained_memory(replicas: faults.Replicas, timeout_s: float = 30.0) -> dict[str, Any]:
    """Replica memory once every session has closed (or after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        memory = faults.memory(replicas)
        drained = all(memory[side]["sessions"] == 0 for side in faults.SIDES)
        if drained or time.monotonic() > deadline:
            return memory
        time.sleep(1.0)


def format_table(result: dict[str, Any]) -> str:
    lines = ["| concurrency | mode | tokens/s | requests | TTFT p50 ms | ITL p50 ms | errors |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for level in result["levels"]:
        for mode in ("speculative", "target_only", HF_MODE):
            if mode not in level:
                continue
            run = level[mode]
            ttft, itl = run["ttft_ms"]["p50"], run["itl_ms"]["p50"]
            lines.append(
                f"| {level['concurrency']} | {mode} | {run['tokens_per_s']:.2f} | "
                f"{run['requests']} | {'–' if ttft is None else f'{ttft:.0f}'} | "
                f"{'–' if itl is None else f'{itl:.0f}'} | "
                f"{sum(run['errors'].values()) if 'errors' in run else '–'} |"
            )
        if "speedup" in level:
            lines.append(f"| {level['concurrency']} | speedup | {level['speedup']:.2f}x | | | | |")
        over_hf = goals([level])["levels"][0].get(f"speculative_over_{HF_MODE}")
        if over_hf is not None:
            lines.append(f"| {level['concurrency']} | speedup vs HF | {over_hf:.2f}x | | | | |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    levels = result["levels"]
    concurrency = [level["concurrency"] for level in levels]
    fig, (rate_ax, speedup_ax) = plt.subplots(1, 2, figsize=(11.0, 4.0))
    try:
        for mode in ("speculative", "target_only", HF_MODE):
            if all(mode in lv for lv in levels):
                rate_ax.plot(concurrency, [lv[mode]["tokens_per_s"] for lv in levels],
                             marker="o", label=mode)  # fmt: skip
        rate_ax.set_xlabel("concurrent streams")
        rate_ax.set_ylabel("aggregate tokens/s")
        rate_ax.legend()
        rate_ax.grid(alpha=0.3)
        speedup_ax.plot(concurrency, [lv["speedup"] for lv in levels], marker="o",
                        label="speculative / target_only")  # fmt: skip
        with_hf = all(HF_MODE in lv for lv in levels)
        if with_hf:
            speedup_ax.plot(
                concurrency,
                [math.nan if (r := ratios[f"speculative_over_{HF_MODE}"]) is None else r
                 for ratios in goals(levels)["levels"]],
                marker="s", label=f"speculative / {HF_MODE}",
            )  # fmt: skip
            speedup_ax.legend()
        speedup_ax.axhline(1.0, color="gray", linestyle="--")
        speedup_ax.set_xlabel("concurrent streams")
        speedup_ax.set_ylabel("speedup of speculative" if with_hf else "speculative / target-only")
        speedup_ax.set_ylim(bottom=0)
        speedup_ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
