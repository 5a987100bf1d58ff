"""`tandem loadtest`: concurrent streaming load against a running service (see
`cluster.tools.bench.loadtest`).

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

Every run (each level, each mode) also reports `cpu_ms_per_token`: CPU per generated token by
process role (router, proxy, controller, registry, drafter, verifier, Ray's own, and
`service_total`), with the load client (this process) apart, and `cpu` (seconds, cores busy,
each process): `cluster.tools.bench.process_cpu`, over the processes of the service `tandem
serve` started here when `--address` is its port, else every Ray or Tandem process of this user
(`cpu_scope` in the JSON). The load streams from one asyncio event loop. Against the service
`tandem serve` started here, each run also reports `replica_traffic`: per side, the Frames
stream's frames each way, entries and results per generated token, results per frame and frames
per engine step (`cluster.tools.bench.replica_traffic`), and the verifier's step occupancy: the
mean number of sessions in a verifier step over the mean number running (`occupancy`,
`running_per_step`, `stepped_per_step`; 1.0 when every running session is in every step).

`--compare --hf-baseline` adds `hf_target_batched` at every level: Hugging Face serving the
target alone at the same concurrency, in this process (`cluster.tools.baselines.hf_baseline`),
after the service's runs of the level, so the two never share the CPU. It loads the target the
service's verifier runs, in its dtype, with every core of the machine: the single batched server
one would run instead (`cluster.tools.baselines.hf_levels.service_target`: `--preset`, else the
model the service reports when `tandem serve` started it here; `--serve-config` for the rest),
and runs greedy (`--temperature 0`). `hf_baseline` in the JSON says which method ran and why.
`goals` gives per level speculative's tokens/s over target_only's and over hf_target_batched's,
and speculative at 8 streams over 1 when both levels ran.

`--predraft` runs three speculative modes at every level: `speculative` pipelining without
pre-drafting, `serial` rounds, and `predrafted` (outcome-keyed pre-drafting up to the widest
fan-out, the adaptive plan's budget choosing each round's, `cluster.routing.predraft_budget`),
each beside its ideal with a sim preset.

`--preset NAME` says which pair the service runs (loadtest cannot always ask it). A simulated
preset (`sim-...`, `cluster.runtime.sim`) adds the analytic ideal of every level and mode
(`cluster.tools.bench.loadtest_ideal`): `ideal` (aggregate tokens/s a perfect system would reach at
that many streams: speculative, the better of serial and pipelined rounds, at the draft's
alpha and the requests' block length, `--draft-tokens` else the service's default; target-only;
at the mean prompt length in the preset's tokens plus half of `--max-tokens`) and
`achieved_over_ideal` per mode, in the JSON, the table and (dashed) the plot; `sim` in the JSON
says what they were computed from. The ideal takes the draft's greedy agreement alpha as the
acceptance: sampled runs (`--temperature` > 0) accept differently. A simulated model has no
device speed outside the service, so `--hf-baseline` refuses a sim preset. When the service
`tandem serve` started here reports another preset, the run refuses to start.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from cluster.runtime.errors import InvalidArgumentError
from cluster.serve import ray_cluster
from cluster.tools import faults

if TYPE_CHECKING:
    from cluster.api.client import AsyncTandemClient
    from cluster.tools.baselines.hf_levels import HFLevels
    from cluster.tools.bench.loadtest_ideal import SimIdeal
    from cluster.tools.bench.process_cpu import Scope

MAX_CONCURRENCY = 256
MAX_DURATION_S = 3600.0
HF_MODE = "hf_target_batched"


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
        result = _run(args, prompts, started, hf, sim)
    finally:  # Ctrl-C too: free the baseline's model
        if hf is not None:
            hf.close()
    write_result(result, args.json_out, args.plot, plot, format_table)
    return 0


def _run(
    args: argparse.Namespace,
    prompts: list[str],
    started: float,
    hf: HFLevels | None,
    sim: SimIdeal | None = None,
) -> dict[str, Any]:
    from cluster.api.client import TandemClient
    from cluster.tools import cleanup
    from cluster.tools.bench.loadtest import run_load, speculation_line
    from cluster.tools.bench.loadtest_ideal import ideal_of_level
    from cluster.tools.bench.process_cpu import CpuWindow, cpu_fields, cpu_line
    from cluster.tools.bench.replica_traffic import read_traffic, traffic_line, traffic_per_token

    modes = run_modes(args.draft_tokens, args.compare, args.predraft)
    levels: list[dict[str, Any]] = []
    replicas = _local_replicas(args.kill is not None)
    kills: list[dict[str, Any]] = []
    memory_before = faults.memory(replicas) if replicas is not None else None
    scope = _cpu_scope(args.address)
    with (
        TandemClient(args.address, timeout_s=600, api_key=ray_cluster.api_key()) as client,
        _async_client(args.address, args.connections) as (loop, load_client),
    ):
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
                    "temperature": args.temperature,
                    **modes[name],
                }
                midway = None
                if args.kill is not None and name == "speculative":
                    assert replicas is not None
                    midway = faults.kill_busiest(args.kill, replicas, kills)
                secret = ray_cluster.cluster_secret() if replicas is not None else None
                traffic = read_traffic(replicas, secret) if replicas is not None else None
                window = CpuWindow(scope)
                window.start()
                try:
                    run = loop.run(run_load(load_client, prompts, concurrency, args.duration,
                                            settings, midway, reference))  # fmt: skip
                finally:  # Ctrl-C too: stop the window's poller
                    window.close()
                level[name] = {**run, **cpu_fields(window.stop(run["tokens"], run["seconds"]))}
                if replicas is not None and traffic is not None:
                    after = read_traffic(replicas, secret)
                    level[name]["replica_traffic"] = traffic_per_token(
                        traffic, after, run["tokens"]
                    )
                    _say(started, f"concurrency {concurrency} {name}: "
                         f"{traffic_line(level[name]['replica_traffic'])}")  # fmt: skip
                print(f"[{time.monotonic() - started:7.1f}s] concurrency {concurrency} {name}: "
                      f"{level[name]['tokens_per_s']:.2f} tokens/s, "
                      f"{level[name]['requests']} requests, errors {level[name]['errors']}, "
                      f"lost {level[name]['lost']}, corrupted {level[name]['corrupted']}; "
                      f"{speculation_line(level[name]['speculation'])}; "
                      f"{cpu_line(level[name]['cpu_ms_per_token'])}",
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
            if sim is not None:
                level.update(ideal_of_level(sim, level))
                _say(started, f"concurrency {concurrency} achieved/ideal: " + ", ".join(
                    f"{mode} {_fixed(ratio)} (ideal {_ideal_text(level['ideal'], mode)})"
                    for mode, ratio in level["achieved_over_ideal"].items()))  # fmt: skip
            levels.append(level)
    result = {
        "config": {"address": args.address, "duration_s": args.duration,
                   "max_tokens": args.max_tokens, "draft_tokens": args.draft_tokens,
                   "temperature": args.temperature, "kill": args.kill,
                   "predraft": args.predraft,
                   "prompts": args.prompts or "default", "preset": args.preset},
        "levels": levels,
        "lost": sum(lv[m]["lost"] for lv in levels for m in modes),
        "corrupted": None if reference is None
                     else sum(lv[m]["corrupted"] for lv in levels for m in modes),
        "killed": kills,
        "cpu_scope": scope.description,
        "memory": {"before": memory_before,
                   "after": _drained_memory(replicas) if replicas is not None else None},
    }  # fmt: skip
    result["goals"] = goals(levels)
    if sim is not None:
        result["sim"] = sim.describe()
    if hf is not None:
        result["hf_baseline"] = hf.describe()
        result["config"]["serve_config"] = args.serve_config
    return result


def _cpu_scope(address: str) -> Scope:
    """Whose CPU a window counts: the Ray cluster of the service `tandem serve` started here when
    `address` is its port, else every Ray or Tandem process of this user
    (`cluster.tools.bench.process_cpu`)."""
    from cluster.tools.bench.process_cpu import cluster_scope, user_scope

    state = ray_cluster.load_state()
    if state is not None and state.serves_grpc_on(address.rpartition(":")[2]):
        return cluster_scope(state.temp_dir)
    return user_scope()


@contextmanager
def _async_client(
    address: str, connections: int = 1
) -> Iterator[tuple[asyncio.Runner, list[AsyncTandemClient]]]:
    """An event loop and `connections` asyncio clients on it, each over a TCP connection of its
    own, for the load (`run_load`, which spreads the streams over them): every stream of a
    level on one thread, which costs the client far less CPU than a thread per stream."""
    from cluster.api.client import AsyncTandemClient

    async def open_clients() -> list[AsyncTandemClient]:
        return [
            AsyncTandemClient(
                address, timeout_s=600, api_key=ray_cluster.api_key(), own_connection=True
            )
            for _ in range(connections)
        ]

    with asyncio.Runner() as loop:
        clients = loop.run(open_clients())
        try:
            yield loop, clients
        finally:
            for client in clients:
                loop.run(client.close())


def _say(started: float, message: str) -> None:
    print(f"[{time.monotonic() - started:7.1f}s] {message}", file=sys.stderr, flush=True)


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


def _ideal_text(ideal: dict[str, float | None], mode: str) -> str:
    value = ideal[f"{mode}_tokens_per_s"]
    return "unbounded: the device costs nothing" if value is None else f"{value:.2f} tokens/s"


def _fixed(value: float | None, digits: int = 2) -> str:
    """A number to `digits` places; "–" for None (an unbounded ideal, or no ratio)."""
    return "–" if value is None else f"{value:.{digits}f}"


def _load_baseline(args: argparse.Namespace, prompts: list[str], started: float) -> HFLevels:
    """Find the target the service's verifier runs (`service_target`) and load it here."""
    from cluster.tools.baselines.hf_levels import HFLevels, reported_model, service_target

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


def run_modes(draft_tokens: int | None, compare: bool, predraft: bool) -> dict[str, dict[str, Any]]:
    """Each mode's request settings: `speculative` (the service's way), and with `predraft`
    `serial`, `predrafted` (up to the widest fan-out, the plan's budget deciding) and
    `speculative` pipelining without pre-drafting; with `compare`, `target_only`."""
    from cluster.runtime.limits import MAX_PREDRAFT_FAN_OUT

    modes: dict[str, dict[str, Any]] = {"speculative": {"draft_tokens": draft_tokens}}
    if predraft:
        modes["speculative"]["predraft_fan_out"] = 0
        modes["serial"] = {"draft_tokens": draft_tokens, "pipelined": False, "predraft_fan_out": 0}
        modes["predrafted"] = {
            "draft_tokens": draft_tokens,
            "pipelined": True,
            "predraft_fan_out": MAX_PREDRAFT_FAN_OUT,
        }
    if compare:
        modes["target_only"] = {"draft_tokens": 0}
    return modes


RUN_MODES = ("speculative", "serial", "predrafted", "target_only")
"""Every mode a load test may run, in the order tables and plots show them."""


def _local_replicas(required: bool) -> faults.Replicas | None:
    """The live replicas of the service `tandem serve` started here, if there is one."""
    from cluster.serve import ray_cluster

    if ray_cluster.load_state() is None:
        if required:
            raise InvalidArgumentError("--kill needs the service tandem serve started here")
        return None
    return ray_cluster.live_replicas


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
    """Markdown: a row per level and mode, then the level's speedups; with a sim preset, each
    mode's ideal tokens/s and achieved/ideal ("–": unbounded, or no ideal for the mode); then
    CPU ms per generated token by process role, a row per level and mode."""
    from cluster.tools.bench.process_cpu import cpu_section

    with_ideal = any("ideal" in level for level in result["levels"])
    with_occupancy = any(
        _occupancy(level[mode]) is not None
        for level in result["levels"]
        for mode in RUN_MODES
        if mode in level
    )
    header = ["concurrency", "mode", "tokens/s", "requests", "TTFT p50 ms", "ITL p50 ms",
              "errors", *(["ideal tokens/s", "achieved/ideal"] if with_ideal else []),
              *(["step occupancy", "running per step"] if with_occupancy else [])]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def row(*cells: str) -> str:
        return "| " + " | ".join([*cells, *[""] * (len(header) - len(cells))]) + " |"

    for level in result["levels"]:
        concurrency = str(level["concurrency"])
        for mode in (*RUN_MODES, HF_MODE):
            if mode not in level:
                continue
            run = level[mode]
            ttft, itl = run["ttft_ms"]["p50"], run["itl_ms"]["p50"]
            cells = [concurrency, mode, f"{run['tokens_per_s']:.2f}", str(run["requests"]),
                     _fixed(ttft, 0), _fixed(itl, 0),
                     str(sum(run["errors"].values())) if "errors" in run else "–"]  # fmt: skip
            if with_ideal:
                ideal = level.get("ideal", {}).get(f"{mode}_tokens_per_s")
                ratio = level.get("achieved_over_ideal", {}).get(mode)
                cells += [_fixed(ideal), _fixed(ratio)]
            if with_occupancy:
                verifier = run.get("replica_traffic", {}).get("verifier", {})
                cells += [_fixed(verifier.get("occupancy"), 3),
                          _fixed(verifier.get("running_per_step"), 1)]  # fmt: skip
            lines.append(row(*cells))
        if "speedup" in level:
            lines.append(row(concurrency, "speedup", f"{level['speedup']:.2f}x"))
        over_hf = goals([level])["levels"][0].get(f"speculative_over_{HF_MODE}")
        if over_hf is not None:
            lines.append(row(concurrency, "speedup vs HF", f"{over_hf:.2f}x"))
    sim = result.get("sim")
    if sim is not None:
        bounded = any(lv["ideal"]["speculative_tokens_per_s"] for lv in result["levels"])
        lines += [
            "",
            f"ideal: {sim['preset']} ({sim['target']} + {sim['draft']}), alpha "
            f"{sim['alpha']:.2f}, k {sim['draft_tokens']}, context {sim['context_tokens']:.1f} "
            f"tokens (prompts {sim['mean_prompt_tokens']:.1f} + half of max_tokens); "
            "speculative: the better of serial and pipelined"
            + ("" if bounded else "; –: unbounded, the simulated device costs nothing"),
        ]
    cpu_rows = [
        ((str(level["concurrency"]), mode), level[mode]["cpu_ms_per_token"])
        for level in result["levels"]
        for mode in RUN_MODES
        if "cpu_ms_per_token" in level.get(mode, {})
    ]
    lines += cpu_section(("concurrency", "mode"), cpu_rows, result.get("cpu_scope"))
    return "\n".join(lines) + "\n"


def _occupancy(run: dict[str, Any]) -> float | None:
    """The verifiers' step occupancy over a run (`replica_traffic`), if it was read."""
    verifier = run.get("replica_traffic", {}).get("verifier", {})
    occupancy: float | None = verifier.get("occupancy")
    return occupancy


def _ideal_series(levels: list[dict[str, Any]], mode: str) -> list[float] | None:
    """`mode`'s ideal tokens/s per level (NaN where unbounded); None if no level has one."""
    values = [lv.get("ideal", {}).get(f"{mode}_tokens_per_s") for lv in levels]
    if all(v is None for v in values):
        return None
    return [math.nan if v is None else float(v) for v in values]


def plot(result: dict[str, Any], path: str) -> None:
    from cluster.tools.bench.output import pyplot

    plt = pyplot()
    levels = result["levels"]
    concurrency = [level["concurrency"] for level in levels]
    fig, (rate_ax, speedup_ax) = plt.subplots(1, 2, figsize=(11.0, 4.0))
    try:
        for mode in (*RUN_MODES, HF_MODE):
            if all(mode in lv for lv in levels):
                (line,) = rate_ax.plot(concurrency, [lv[mode]["tokens_per_s"] for lv in levels],
                                       marker="o", label=mode)  # fmt: skip
                ideal = _ideal_series(levels, mode)
                if ideal is not None:
                    rate_ax.plot(concurrency, ideal, linestyle="--", color=line.get_color(),
                                 label=f"{mode} ideal")  # fmt: skip
        rate_ax.set_xlabel("concurrent streams")
        rate_ax.set_ylabel("aggregate tokens/s")
        rate_ax.legend()
        rate_ax.grid(alpha=0.3)
        speedup_ax.plot(concurrency, [lv["speedup"] for lv in levels], marker="o",
                        label="speculative / target_only")  # fmt: skip
        for mode in ("serial", "predrafted"):
            if all(mode in lv for lv in levels):
                speedup_ax.plot(
                    concurrency,
                    [lv[mode]["tokens_per_s"] / lv["target_only"]["tokens_per_s"] for lv in levels],
                    marker="^", label=f"{mode} / target_only",
                )  # fmt: skip
        speedup_ax.legend()
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
