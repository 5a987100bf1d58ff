"""The levels of `tandem loadtest`: at each concurrency, each mode's streaming load, measured.

`run_levels` streams from one asyncio event loop (`--connections` clients, each over a TCP
connection of its own), the modes' order alternating level by level (`run_modes`: each mode's
request settings). With `--temperature 0` the target alone's outputs are fetched once per prompt
before the load, and a completed output that differs is `corrupted` (exact for float32 models;
in bfloat16 a near-tie can round differently in a 5-token verify pass than in a 1-token step);
`lost` counts requests that started and did not complete. `--kill drafter|verifier` (the
service `tandem serve` started here) SIGKILLs the replica of that side holding the most sessions
half way through each level's speculative run. Replica memory (sessions, cached tokens, resident
MiB per side) is read before the load and after it, once the sessions have drained.

Every run also reports `cpu_ms_per_token`, CPU per generated token by process role (router,
proxy, controller, registry, drafter, verifier, Ray's own, and `service_total`), with the load
client (this process) apart, and `cpu` (seconds, cores busy, each process):
`cluster.tools.bench.process_cpu`, over the processes of the service `tandem serve` started here
when `--address` is its port, else every Ray or Tandem process of this user (`cpu_scope`).
Against the service `tandem serve` started here, each run also reports `replica_traffic`: per
side, the Frames stream's frames each way, entries and results per generated token, results per
frame and frames per engine step (`cluster.tools.bench.replica_traffic`), and the verifier's step
occupancy: the mean number of sessions in a verifier step over the mean number running
(`occupancy`, `running_per_step`, `stepped_per_step`; 1.0 when every running session is in every
step). Progress goes to stderr, a line per run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from cluster.cli.loadtest_report import HF_MODE, fixed, goals, ideal_text
from cluster.runtime.errors import InvalidArgumentError
from cluster.serve import ray_cluster
from cluster.tools import faults

if TYPE_CHECKING:
    from cluster.api.client import AsyncTandemClient
    from cluster.tools.baselines.hf_levels import HFLevels
    from cluster.tools.bench.loadtest_ideal import SimIdeal
    from cluster.tools.bench.process_cpu import Scope


def run_levels(
    args: argparse.Namespace,
    prompts: list[str],
    started: float,
    hf: HFLevels | None,
    sim: SimIdeal | None = None,
) -> dict[str, Any]:
    """Every level of `args.concurrency`, each mode in turn (then `hf`'s level, and `sim`'s
    ideal): the result `tandem loadtest` writes, `goals` included."""
    from cluster.api.client import TandemClient
    from cluster.tools import cleanup
    from cluster.tools.bench.cpu_table import cpu_line
    from cluster.tools.bench.cpu_usage import cpu_fields
    from cluster.tools.bench.loadtest import run_load, speculation_line
    from cluster.tools.bench.loadtest_ideal import ideal_of_level
    from cluster.tools.bench.process_cpu import CpuWindow
    from cluster.tools.bench.replica_traffic import read_traffic, traffic_line, traffic_per_token

    modes = run_modes(args.draft_tokens, args.compare, args.predraft)
    levels: list[dict[str, Any]] = []
    replicas = _local_replicas(args.kill is not None)
    kills: list[dict[str, Any]] = []
    memory_before = faults.memory(replicas) if replicas is not None else None
    scope = cpu_scope(args.address)
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
                    say(started, f"concurrency {concurrency} {name}: "
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
                say(started, f"concurrency {concurrency} {HF_MODE} ({hf.method}): "
                     f"{level[HF_MODE]['tokens_per_s']:.2f} tokens/s, "
                     f"{level[HF_MODE]['requests']} requests")  # fmt: skip
            if args.compare:
                level["speedup"] = (
                    level["speculative"]["tokens_per_s"] / level["target_only"]["tokens_per_s"]
                )
            if sim is not None:
                level.update(ideal_of_level(sim, level))
                say(started, f"concurrency {concurrency} achieved/ideal: " + ", ".join(
                    f"{mode} {fixed(ratio)} (ideal {ideal_text(level['ideal'], mode)})"
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


def cpu_scope(address: str) -> Scope:
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


def say(started: float, message: str) -> None:
    """A progress line on stderr, stamped with the seconds since `started`."""
    print(f"[{time.monotonic() - started:7.1f}s] {message}", file=sys.stderr, flush=True)


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
