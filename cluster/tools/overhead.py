"""Measure the data plane: what one block costs over gRPC against the same calls in-process.

`python -m cluster.tools.overhead` finds the drafter and verifier replicas of the running service
(TANDEM_HOME, as `tandem serve` recorded it) and times, per block, router -> drafter -> router
-> verifier -> router: `draft` then `verify` of a greedy session. The same sessions then run on
in-process copies of the same models. Greedy decoding makes both do identical work, so the
per-round difference is the transport's cost. The in-process side uses the replicas'
intra-op thread count (`--threads`; Ray gives a replica with `num_cpus` 0 one thread). Runs are
interleaved (remote, local, remote...)
and repeated; the report gives p50 and p99 of block time in each mode, of the paired
difference, and of a bare round trip (the two replicas' Stats calls: transport alone).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from collections.abc import Sequence
from typing import Any

from cluster.routing.ports import DrafterPort, VerifierPort
from cluster.serve import local_cluster
from cluster.tools.cleanup import signals_raise
from verifier.runtime.sampling import SamplingParams

PROMPT = tuple(b"def add(a, b):\n    return a + b\n\n")
GREEDY = SamplingParams()


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _summary(values_s: Sequence[float]) -> dict[str, float]:
    return {
        "p50_ms": 1000 * _percentile(values_s, 0.5),
        "p99_ms": 1000 * _percentile(values_s, 0.99),
        "mean_ms": 1000 * statistics.fmean(values_s),
        "count": len(values_s),
    }


def _session_rounds(
    drafter: DrafterPort, verifier: VerifierPort, rounds: int, draft_tokens: int
) -> list[float]:
    """Block times (s) of one greedy session of `rounds` draft/verify rounds."""
    session = uuid.uuid4().hex
    verifier.open_session(session, PROMPT, GREEDY, 0)
    drafter.open_session(session, PROMPT, GREEDY, 0)
    base, behind, times = len(PROMPT), list[int](), list[float]()
    try:
        for _ in range(rounds):
            start = time.perf_counter()
            block = drafter.draft(session, base, behind, draft_tokens)
            verdict = verifier.verify(session, block)
            times.append(time.perf_counter() - start)
            base, behind = block.base_length, list(verdict.tokens)
    finally:
        drafter.close_session(session)
        verifier.close_session(session)
    return times


def measure(sessions: int, rounds: int, draft_tokens: int, threads: int) -> dict[str, Any]:
    address = local_cluster.replica_addresses()
    from cluster.local import build_local
    from cluster.presets import resolve_pair
    from cluster.routing.replica_client import GrpcDrafter, GrpcVerifier

    local = build_local(resolve_pair("tiny", device="cpu"))
    import torch

    torch.set_num_threads(threads)

    remote: list[float] = []
    in_process: list[float] = []
    bare: list[float] = []
    secret = local_cluster.cluster_secret()
    with (
        GrpcDrafter(address["drafter"], secret=secret) as remote_drafter,
        GrpcVerifier(address["verifier"], secret=secret) as remote_verifier,
    ):
        for i in range(sessions + 1):
            r = _session_rounds(remote_drafter, remote_verifier, rounds, draft_tokens)
            lo = _session_rounds(local.drafter, local.verifier, rounds, draft_tokens)
            for _ in range(rounds):
                start = time.perf_counter()
                remote_drafter.stats()
                remote_verifier.stats()
                bare.append(time.perf_counter() - start)
            if i > 0:  # the first pair warms caches and connections
                remote.extend(r)
                in_process.extend(lo)
    paired = [a - b for a, b in zip(remote, in_process, strict=True)]
    return {
        "config": {
            "sessions": sessions,
            "rounds": rounds,
            "draft_tokens": draft_tokens,
            "in_process_threads": threads,
        },
        "remote_block": _summary(remote),
        "in_process_block": _summary(in_process),
        "overhead_per_block": _summary(paired),
        "bare_round_trip": _summary(bare),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="in-process torch threads")
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C: each session's `finally` closes it on the replicas.
    with signals_raise():
        report = measure(args.sessions, args.rounds, args.draft_tokens, args.threads)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
