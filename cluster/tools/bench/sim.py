"""`tandem bench --preset sim-...`: Tandem on a simulated device, against the analytic ideal.

A simulated pair (`cluster.runtime.sim`) runs the real router, engines, KV blocks, sampling and
acceptance with every forward pass replaced by a modelled wait, so what the run takes beyond the
modelled device time is Tandem's own. Three runs, interleaved per prompt and repeated (medians):
`tandem_target` (draft length 0), `tandem_serial` and `tandem_pipelined`, and a fourth,
`tandem_predrafted` (outcome-keyed pre-drafting at the ideal's best fan-out, with its hit rate;
through the service, each request asks for it with its `predraft_fan_out`). Each is reported
against the ideal for the same costs (`sim.ideal_rates`: the measured acceptance, the block
length, the modelled pass times at the run's mean context, and the draft's agreement alpha).

In `--mode local` (one process) each request also reads both engines' counters before and
after (`EngineStats`), which splits a round's time into: device (modelled), forward overhead
(the runner's own work beside the wait: logits, KV bookkeeping), acceptance (batched handlers),
engine (packing, tasks, sampling in the tasks), gather (waiting for sessions to come back), and
the rest: the router (planning, prompt lookup, detokenising) and the hand-offs between its
thread and the engines'. Tandem's own time per round (wall minus modelled device time on the
critical path) is given p50 and p99 over requests. Pipelined rounds overlap draft and verify, so
their device time and own time are not additive and are left out ("–"): judge them by achieved
against ideal.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from cluster.runtime.engine_stats import EngineStats
from cluster.tools.bench.cpu_table import cpu_section
from cluster.tools.bench.process_cpu import CpuCalls, cluster_scope
from cluster.tools.prompt_files import Prompt, load_prompts

SIM_RUNS = ("tandem_target", "tandem_serial", "tandem_pipelined")
STAGES = ("device", "forward_overhead", "acceptance", "engine", "gather", "router_and_handoffs")


def percentile(values: Sequence[float], q: float) -> float:
    """The `q` quantile of `values` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def is_sim_preset(preset: str) -> bool:
    from cluster.presets import PRESETS
    from cluster.runtime.sim_source import SIM_SCHEME

    known = PRESETS.get(preset)
    return known is not None and known.target.startswith(SIM_SCHEME)


def _split(
    before: tuple[EngineStats, EngineStats], after: tuple[EngineStats, EngineStats], wall_s: float
) -> dict[str, float]:
    """Seconds of one request by stage (see the module docstring); device counts the draft's
    modelled time too, as serial rounds wait for it."""
    d = {
        name: sum(getattr(a, name) - getattr(b, name) for a, b in zip(after, before, strict=True))
        for name in ("busy_s", "forward_s", "device_s", "batched_s", "gather_s")
    }
    parts = {
        "device": d["device_s"],
        "forward_overhead": d["forward_s"] - d["device_s"],
        "acceptance": d["batched_s"],
        "engine": d["busy_s"] - d["forward_s"] - d["batched_s"],
        "gather": d["gather_s"],
    }
    parts["router_and_handoffs"] = wall_s - sum(parts.values())
    return parts


Generate = Callable[[tuple[int, ...], int, bool, int, str], Any]
Engines = Callable[[], tuple[EngineStats, EngineStats]]


@contextmanager
def _in_process(pair: Any, settings: dict[str, Any], max_tokens: int) -> Iterator[Any]:
    """(encode, generate, engines) over drafter, verifier and router in this process."""
    from cluster.local import build_local
    from cluster.routing.request import GenerationRequest
    from cluster.tools.bench.settings import router_settings

    local = build_local(pair, **router_settings(settings))

    def generate(
        prompt: tuple[int, ...], k: int, pipelined: bool, fan_out: int = 0, tenant: str = ""
    ) -> Any:
        local.router.predraft_fan_out = fan_out
        request = GenerationRequest(prompt, max_tokens, draft_tokens=k, tenant=tenant)
        result = local.router.generate(request, pipelined=pipelined)
        return result.tokens, result.stats

    def engines() -> tuple[EngineStats, EngineStats]:
        return local.verifier.engine.stats(), local.drafter.engine.stats()

    try:
        yield local.tokenizer.encode, generate, engines, None
    finally:
        local.router.close()


@contextmanager
def _through_service(
    args: Any, settings: dict[str, Any], progress: Callable[[str], None]
) -> Iterator[Any]:
    """(encode, generate, engines) through a `tandem serve` of one drafter and one verifier
    started in a private home (`cluster.tools.bench.private_service`): requests go through the
    public gRPC API, each replica's counters come from its Stats call, outside the timed
    region."""
    from cluster.api.client import TandemClient
    from cluster.config import CLUSTER_SECRET_ENV
    from cluster.presets import resolve_pair
    from cluster.routing.grpc_drafter import GrpcDrafter
    from cluster.routing.grpc_verifier import GrpcVerifier
    from cluster.runtime.models import load_tokenizer
    from cluster.serve import ray_cluster
    from cluster.tools import cleanup
    from cluster.tools.bench.private_service import private_service
    from cluster.tools.bench.settings import serve_flags

    flags = [*serve_flags(args, settings), "--drafters", "1", "--verifiers", "1"]
    with private_service(args.preset, flags, progress) as (address, api_key, home):
        # Asked of `tandem status` in its own process: a process that joined the cluster would
        # hold files in its temp dir and be stopped with it.
        status = subprocess.run(
            [cleanup.tandem_command(), "status", "--json"],
            env={**os.environ, ray_cluster.HOME_ENV: str(home)},
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        replicas = {r["side"]: r["address"] for r in json.loads(status.stdout)["replicas"]}
        secret = os.environ.get(CLUSTER_SECRET_ENV) or (home / "cluster_secret").read_text()
        tokenizer = load_tokenizer(resolve_pair(args.preset).target).tokenizer
        with (
            TandemClient(address, timeout_s=600, api_key=api_key) as client,
            GrpcVerifier(replicas["verifier"], secret=secret) as verifier,
            GrpcDrafter(replicas["drafter"], secret=secret) as drafter,
        ):

            def generate(
                prompt: tuple[int, ...], k: int, pipelined: bool, fan_out: int = 0, tenant: str = ""
            ) -> Any:  # the service's one tenant: the suffix drafter is off there (settings.py)
                result = client.generate(
                    list(prompt), max_tokens=args.max_tokens, draft_tokens=k,
                    pipelined=pipelined, predraft_fan_out=fan_out,
                )  # fmt: skip
                return result.tokens, result

            def engines() -> tuple[EngineStats, EngineStats]:
                stats = verifier.stats().engine, drafter.stats().engine
                assert stats[0] is not None and stats[1] is not None, "replicas run engines"
                return stats[0], stats[1]

            cpu = CpuCalls(cluster_scope(str(home / "ray")), (*SIM_RUNS, "tandem_predrafted"))
            yield tokenizer.encode, generate, engines, cpu


def run_sim_bench(args: Any, progress: Callable[[str], None]) -> dict[str, Any]:
    from cluster.presets import resolve_pair
    from cluster.runtime import sim, sim_source
    from cluster.tools.bench.settings import bench_settings

    prompts: list[Prompt] = load_prompts(args.prompts)
    settings = bench_settings(args)
    pair = resolve_pair(args.preset)
    target_source = sim_source.SimSource.parse(pair.target.source)
    draft_source = sim_source.SimSource.parse(pair.draft.source)
    progress(f"simulated pair {pair.target.source} + {pair.draft.source}; settings {settings}")
    configs = {"tandem_target": (0, False, 0), "tandem_serial": (args.draft_tokens, False, 0),
               "tandem_pipelined": (args.draft_tokens, True, 0)}  # fmt: skip
    with (
        _in_process(pair, settings, args.max_tokens)
        if args.mode == "local"
        else _through_service(args, settings, progress)
    ) as (encode, generate, engines, cpu):
        ids = [tuple(encode(p.text, add_special_tokens=False)) for p in prompts]
        context = statistics.mean(len(p) for p in ids) + args.max_tokens / 2
        alpha = draft_source.alpha  # per position; a run's accepted/drafted counts a block's tail
        ideal = sim.ideal_rates(
            target_source.profile, draft_source.profile, alpha, args.draft_tokens,
            context_tokens=round(context),
        )  # fmt: skip
        if ideal.predraft_fan_out:
            configs["tandem_predrafted"] = (args.draft_tokens, True, ideal.predraft_fan_out)
        names = list(configs)
        records: dict[str, list[list[dict[str, Any]]]] = {n: [[] for _ in ids] for n in configs}
        for repeat in range(args.repeats):
            for index, prompt in enumerate(ids):
                shift = (repeat + index) % len(names)
                for name in names[shift:] + names[:shift]:
                    k, pipelined, fan_out = configs[name]
                    # A tenant per run and repeat: the suffix drafter never drafts a prompt's
                    # answer from its own earlier repeat (the simulated target repeats it).
                    record = _one(
                        generate, engines, prompt, k, pipelined, cpu, name, fan_out,
                        tenant=f"{name}-{repeat}",
                    )  # fmt: skip
                    records[name][index].append(record)
            progress(f"repeat {repeat + 1}/{args.repeats} done")
    runs = {name: _summarize(records[name]) for name in names}
    if cpu is not None:
        for name, fields in cpu.fields().items():
            runs[name].update(fields)
    serial = runs["tandem_serial"]
    achieved = {
        "tandem_target": runs["tandem_target"]["tokens_per_s"] / ideal.target_only,
        "tandem_serial": serial["tokens_per_s"] / ideal.serial,
        "tandem_pipelined": runs["tandem_pipelined"]["tokens_per_s"] / ideal.pipelined,
    }
    if "tandem_predrafted" in runs:
        achieved["tandem_predrafted"] = runs["tandem_predrafted"]["tokens_per_s"] / ideal.predrafted
    return {
        "config": {
            "preset": args.preset, "mode": args.mode, "max_tokens": args.max_tokens,
            "draft_tokens": args.draft_tokens, "repeats": args.repeats,
            "num_prompts": len(prompts), "prompts": args.prompts or "default",
            "settings": settings, "target": pair.target.source, "draft": pair.draft.source,
            "mean_context_tokens": context,
        },
        "runs": runs,
        "ideal": {
            "alpha": alpha,
            "target_only_tokens_per_s": ideal.target_only,
            "serial_tokens_per_s": ideal.serial,
            "pipelined_tokens_per_s": ideal.pipelined,
            "predrafted_tokens_per_s": ideal.predrafted,
            "predraft_fan_out": ideal.predraft_fan_out,
            "predraft_hit_rate": ideal.predraft_hit,
            "tokens_per_verify": ideal.tokens_per_verify,
            "verify_ms": 1000 * ideal.verify_s,
            "draft_block_ms": 1000 * ideal.draft_block_s,
        },
        "achieved_over_ideal": achieved,
        **({"cpu_scope": cpu.scope.description} if cpu is not None else {}),
        "speedup": {
            "vs_tandem_target": runs["tandem_pipelined"]["tokens_per_s"]
            / runs["tandem_target"]["tokens_per_s"],
            "pipelining": runs["tandem_pipelined"]["tokens_per_s"] / serial["tokens_per_s"],
            **(
                {"predrafting": runs["tandem_predrafted"]["tokens_per_s"] / serial["tokens_per_s"]}
                if "tandem_predrafted" in runs
                else {}
            ),
        },
    }  # fmt: skip


def _one(
    generate: Generate,
    engines: Engines,
    prompt: tuple[int, ...],
    k: int,
    pipelined: bool,
    cpu: CpuCalls | None = None,
    name: str = "",
    fan_out: int = 0,
    tenant: str = "",
) -> dict[str, Any]:
    """One request, timed, with its engines' counters read before and after; with `cpu`, the
    CPU of the service's processes while it ran (run `name`), read outside the timed region."""
    before = engines()
    counted = cpu.open(name) if cpu is not None else None
    started = time.perf_counter()
    tokens, stats = generate(prompt, k, pipelined, fan_out, tenant)
    wall_s = time.perf_counter() - started
    if counted is not None:
        counted(len(tokens), wall_s)
    stages = _split(before, engines(), wall_s)
    if pipelined:  # draft and verify overlap: the device split is not additive
        stages["device"] = stages["router_and_handoffs"] = float("nan")
    return {
        "wall_s": wall_s,
        "tokens": len(tokens),
        "passes": stats.num_verify_passes,
        "drafted": stats.num_drafted,
        "accepted": stats.num_accepted,
        "hits": stats.pipeline_hits,
        "misses": stats.pipeline_misses,
        "predraft_hits": stats.predraft_hits,
        "predraft_misses": stats.predraft_misses,
        "stages": stages,
    }


def _summarize(per_prompt: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """tokens/s from per-prompt medians; counters summed over every repeat; each request's own
    time per round (wall minus its device time, over its verify passes)."""
    tokens = sum(reps[0]["tokens"] for reps in per_prompt)
    seconds = sum(statistics.median(r["wall_s"] for r in reps) for reps in per_prompt)
    flat = [r for reps in per_prompt for r in reps]

    def total(key: str) -> int:
        return sum(int(r[key]) for r in flat)

    own_ms = [1000 * (r["wall_s"] - r["stages"]["device"]) / r["passes"] for r in flat]
    own = [v for v in own_ms if v == v]  # NaN for pipelined rounds
    passes = total("passes")
    stages = {stage: 1000 * sum(r["stages"][stage] for r in flat) / passes for stage in STAGES}
    hits, misses = total("hits"), total("misses")
    predraft_hits, predraft_misses = total("predraft_hits"), total("predraft_misses")
    predrafted = predraft_hits + predraft_misses
    return {
        "tokens_per_s": tokens / seconds,
        "ms_per_token": 1000 * seconds / tokens,
        "num_tokens": tokens,
        "acceptance_rate": total("accepted") / total("drafted") if total("drafted") else None,
        "mean_tokens_per_verify": sum(r["tokens"] for r in flat) / passes,
        "pipeline_hit_rate": hits / (hits + misses) if hits + misses else None,
        "predraft_hit_rate": predraft_hits / predrafted if predrafted else None,
        "round_ms": 1000 * sum(r["wall_s"] for r in flat) / passes,
        "own_ms_per_round_p50": percentile(own, 0.5) if own else None,
        "own_ms_per_round_p99": percentile(own, 0.99) if own else None,
        "stages_ms_per_round": stages,
    }


def format_sim_table(result: dict[str, Any]) -> str:
    """Markdown: each run against its ideal, and a round's time by stage."""
    ideal = result["ideal"]
    ideal_of = {
        "tandem_target": ideal["target_only_tokens_per_s"],
        "tandem_serial": ideal["serial_tokens_per_s"],
        "tandem_pipelined": ideal["pipelined_tokens_per_s"],
        "tandem_predrafted": ideal["predrafted_tokens_per_s"],
    }
    header = ["run", "tokens/s", "ideal", "achieved/ideal", "acceptance", "tokens/verify",
              "round ms", "own ms/round p50", "p99", *(f"{s} ms" for s in STAGES)]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, run in result["runs"].items():
        acceptance = run["acceptance_rate"]
        cells = [
            name,
            f"{run['tokens_per_s']:.1f}",
            f"{ideal_of[name]:.1f}",
            f"{result['achieved_over_ideal'][name]:.2f}",
            "–" if acceptance is None else f"{100 * acceptance:.1f}%",
            f"{run['mean_tokens_per_verify']:.2f}",
            f"{run['round_ms']:.2f}",
            _ms(run["own_ms_per_round_p50"]),
            _ms(run["own_ms_per_round_p99"]),
            *(_ms(run["stages_ms_per_round"][s]) for s in STAGES),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    speedup = result["speedup"]
    lines += [
        "",
        f"speculative vs target-only {speedup['vs_tandem_target']:.2f}x, pipelined vs serial "
        f"{speedup['pipelining']:.2f}x; ideal: verify {ideal['verify_ms']:.2f} ms, draft block "
        f"{ideal['draft_block_ms']:.2f} ms, {ideal['tokens_per_verify']:.2f} tokens/verify at "
        f"alpha {ideal['alpha']:.2f}",
        f"ideal with outcome-keyed pre-drafting: "
        f"{ideal['predrafted_tokens_per_s']:.1f} tokens/s at fan-out {ideal['predraft_fan_out']}"
        f", {100 * ideal['predraft_hit_rate']:.0f}% of rounds pre-drafted",
    ]
    predrafted = result["runs"].get("tandem_predrafted")
    if predrafted is not None and predrafted["predraft_hit_rate"] is not None:
        lines.append(
            f"pre-drafted vs serial {speedup['predrafting']:.2f}x; "
            f"{100 * predrafted['predraft_hit_rate']:.0f}% of its rounds hit a branch"
        )
    rows = [((name,), run["cpu_ms_per_token"]) for name, run in result["runs"].items()
            if "cpu_ms_per_token" in run]  # fmt: skip
    lines += cpu_section(("run",), rows, result.get("cpu_scope"))
    return "\n".join(lines) + "\n"


def _ms(value: float | None) -> str:
    return "–" if value is None or value != value else f"{value:.2f}"
