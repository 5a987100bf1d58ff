"""Where a round's time goes: draft, verify, replica compute against transport, and the router.

`python -m cluster.tools.bench.profile` joins the service that `tandem serve` runs (TANDEM_HOME),
takes
its first drafter and verifier replica, and runs greedy requests on them through a `Router` in this
process, over the same gRPC clients the service's router uses. Every call to a replica is
timed here (its wall time), and after every call the replica's cumulative `busy_s` is read
(Stats): the difference is the call's compute on the replica, and wall minus compute is
transport (serialisation, the network stack, gRPC, the replica's thread hand-off). That split
is exact only while nothing else runs on the replicas, so profile an otherwise idle service.

Per configuration (target alone, then serial and pipelined speculation at each draft length
given) it reports
ms per token, tokens per verify pass, and per round: the draft calls the router waited for,
the verify call, each split into compute and transport, and the rest (the router's own work,
and in pipelined mode the wait for a draft ahead that outlasted its verify pass). p50 and p99
of per-call transport are the data plane's overhead per block. Reading Stats after each call
costs one extra round trip outside the timed call; pipelined rounds include that too, so their
absolute times are a little pessimistic.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.tools.bench.overhead import _percentile
from cluster.tools.cleanup import signals_raise

ROUND_PARTS = (
    "draft_compute",
    "draft_transport",
    "verify_compute",
    "verify_transport",
    "router_and_waits",
)


def configurations(draft_lengths: Sequence[int]) -> list[tuple[str, int, bool]]:
    """Name, draft length and pipelining of each profiled configuration."""
    configs = [("target_only", 0, False)]
    for k in draft_lengths:
        configs += [(f"serial_k{k}", k, False), (f"pipelined_k{k}", k, True)]
    return configs


@dataclass
class CallLog:
    """Wall and compute seconds of every call to one replica, split by the calling thread."""

    wall_s: list[float] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)
    blocking: list[bool] = field(default_factory=list)
    """True for a call made by the router's own loop, False for a draft ahead."""

    def total(self, values: list[float], blocking: bool) -> float:
        return sum(v for v, b in zip(values, self.blocking, strict=True) if b == blocking)


class Timed:
    """A replica port whose calls are timed and whose compute is read from Stats after each."""

    def __init__(self, port: Any, timed_method: str) -> None:
        self._port = port
        self._method = timed_method
        self._lock = threading.Lock()
        self._busy_s = port.stats().busy_s
        self.log = CallLog()

    def __getattr__(self, name: str) -> Any:
        if name.endswith("_steps") or name == "waits_without_thread":
            # Offer blocking calls only, so each is timed whole (its wall time is the call's)
            # and a draft ahead runs on the router's "draft-ahead" threads.
            raise AttributeError(name)
        method = getattr(self._port, name)
        if name == "stats":
            return method
        if name != self._method:

            def untimed(*args: Any, **kwargs: Any) -> Any:
                # Opening (a prefill) and closing sessions is work outside the rounds: move
                # the baseline past it so that it is not billed to the next timed call.
                result = method(*args, **kwargs)
                with self._lock:
                    self._busy_s = self._port.stats().busy_s
                return result

            return untimed

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            result = method(*args, **kwargs)
            wall_s = time.perf_counter() - started
            with self._lock:
                busy_s = self._port.stats().busy_s
                self.log.wall_s.append(wall_s)
                # The Stats read itself adds microseconds of busy time; keep compute <= wall.
                self.log.compute_s.append(min(wall_s, busy_s - self._busy_s))
                self.log.blocking.append(
                    not threading.current_thread().name.startswith("draft-ahead")
                )
                self._busy_s = busy_s
            return result

        return timed


def profile_config(
    router_for: Any, prompts: Sequence[tuple[int, ...]], max_tokens: int, k: int, pipelined: bool
) -> dict[str, Any]:
    from cluster.routing.request import GenerationRequest

    router, drafter, verifier = router_for()
    tokens = passes = 0
    started = time.perf_counter()
    try:
        for ids in prompts:
            result = router.generate(GenerationRequest(ids, max_tokens, draft_tokens=k), pipelined)
            tokens += len(result.tokens)
            passes += result.stats.num_verify_passes
    finally:
        router.close()
    total_s = time.perf_counter() - started
    # Opening and closing sessions (prefill) is outside the rounds; the rest is per round.
    verify, draft = verifier.log, drafter.log
    verify_wall = verify.total(verify.wall_s, True)
    verify_compute = verify.total(verify.compute_s, True)
    draft_wall = draft.total(draft.wall_s, True)
    draft_compute = draft.total(draft.compute_s, True)
    walls, computes = verify.wall_s + draft.wall_s, verify.compute_s + draft.compute_s
    transport = [w - c for w, c in zip(walls, computes, strict=True)]
    per_round = 1000 / passes
    num_ahead = sum(1 for b in draft.blocking if not b)
    return {
        "ms_per_token": 1000 * total_s / tokens,
        "tokens_per_verify": tokens / passes,
        "rounds": passes,
        "round_ms": {
            "total": total_s * per_round,
            "draft_compute": draft_compute * per_round,
            "draft_transport": (draft_wall - draft_compute) * per_round,
            "verify_compute": verify_compute * per_round,
            "verify_transport": (verify_wall - verify_compute) * per_round,
            "router_and_waits": (total_s - draft_wall - verify_wall) * per_round,
        },
        "draft_ahead_call_ms": 1000 * draft.total(draft.wall_s, False) / max(1, num_ahead),
        "transport_per_call_ms": {
            "p50": 1000 * _percentile(transport, 0.5) if transport else None,
            "p99": 1000 * _percentile(transport, 0.99) if transport else None,
            "calls": len(transport),
        },
    }


def _median(reports: Sequence[Any]) -> Any:
    """Field-wise median of reports with the same shape (numbers; None where any is None)."""
    first = reports[0]
    if isinstance(first, dict):
        return {key: _median([r[key] for r in reports]) for key in first}
    if any(r is None for r in reports):
        return None
    return statistics.median(reports)


def measure(
    preset: str,
    max_tokens: int,
    draft_lengths: Sequence[int],
    repeats: int,
    prompts_path: str | None,
) -> dict[str, Any]:
    from cluster.serve import local_cluster

    address = local_cluster.replica_addresses()
    from cluster.local import text_decoder
    from cluster.presets import resolve_pair
    from cluster.routing.replica_client import GrpcDrafter, GrpcVerifier
    from cluster.routing.router import Router
    from cluster.runtime.models import load_tokenizer
    from cluster.tools.bench.run import load_prompts

    loaded = load_tokenizer(resolve_pair(preset).target)
    encode = loaded.tokenizer.encode
    prompts = [tuple(encode(p.text, add_special_tokens=False)) for p in load_prompts(prompts_path)]
    secret = local_cluster.cluster_secret()
    configs = configurations(draft_lengths)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in configs}
    with (
        GrpcDrafter(address["drafter"], secret=secret) as drafter_client,
        GrpcVerifier(address["verifier"], secret=secret) as verifier_client,
    ):

        def router_for() -> tuple[Router, Timed, Timed]:
            drafter, verifier = Timed(drafter_client, "draft"), Timed(verifier_client, "verify")
            decode = text_decoder(loaded.tokenizer)
            return Router(verifier, drafter, decode, loaded.eos_token_ids), drafter, verifier

        for repeat in range(repeats):
            shift = repeat % len(configs)  # rotate the order: no configuration always runs first
            for name, k, pipelined in configs[shift:] + configs[:shift]:
                runs[name].append(profile_config(router_for, prompts, max_tokens, k, pipelined))
                ms = runs[name][-1]["ms_per_token"]
                print(f"repeat {repeat + 1}/{repeats} {name}: {ms:.0f} ms/token", file=sys.stderr)
    return {
        "config": {"preset": preset, "max_tokens": max_tokens,
                   "draft_lengths": list(draft_lengths),
                   "repeats": repeats, "prompts": prompts_path or "default",
                   "drafter": address["drafter"], "verifier": address["verifier"]},
        "runs": {name: _median(reports) for name, reports in runs.items()},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen-coder", help="the pair the service runs")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--draft-tokens", type=int, nargs="+", default=[4], help="one or more")
    parser.add_argument("--repeats", type=int, default=3, help="medians over this many")
    parser.add_argument("--prompts", help="jsonl as for tandem bench (default: its prompt set)")
    parser.add_argument("--json", dest="json_out", help="write the report here")
    parser.add_argument("--plot", help="tokens/s by draft length and round parts (PNG)")
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C: the router's `finally` closes the sessions it has open on
    # the replicas, instead of leaving them to the replicas' idle sweep.
    with signals_raise():
        report = measure(
            args.preset, args.max_tokens, args.draft_tokens, args.repeats, args.prompts
        )
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    if args.plot:
        plot(report, args.plot)


def plot(report: dict[str, Any], path: str) -> None:
    """Tokens/s against draft length (left) and each configuration's round split (right)."""
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    runs = report["runs"]
    lengths = report["config"]["draft_lengths"]
    fig, (rate_ax, parts_ax) = plt.subplots(1, 2, figsize=(12.0, 4.5))
    try:
        for mode in ("serial", "pipelined"):
            rates = [1000 / runs[f"{mode}_k{k}"]["ms_per_token"] for k in lengths]
            rate_ax.plot(lengths, rates, marker="o", label=mode)
        rate_ax.axhline(1000 / runs["target_only"]["ms_per_token"], color="gray",
                        linestyle="--", label="target alone")  # fmt: skip
        rate_ax.set_xlabel("draft length k")
        rate_ax.set_ylabel("tokens/s")
        rate_ax.set_ylim(bottom=0)
        rate_ax.legend()
        rate_ax.grid(alpha=0.3)
        names = list(runs)
        bottom = [0.0] * len(names)
        for part in ROUND_PARTS:
            heights = [max(0.0, runs[n]["round_ms"][part]) for n in names]
            parts_ax.bar(names, heights, bottom=bottom, label=part)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        parts_ax.set_ylabel("ms per round")
        parts_ax.tick_params(axis="x", rotation=30)
        parts_ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


if __name__ == "__main__":
    main()
