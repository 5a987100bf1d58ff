"""`tandem soak` (also `python -m cluster.tools.soak.run`): the service under a long, mixed and
faulty load, then a check that it lost nothing, changed no greedy output and leaked nothing.

One run, start to end, on a service of its own (`cluster.tools.soak.service`: the default tiny
pair in float32, 2 drafters and 2 verifiers; the verifiers' KV pools sized so that about
`kv_long_requests` long requests fit, which the `concurrency` streams overflow; one drafter
answering `drafter_error_fraction` of its Draft calls INTERNAL, `DrafterConfig.error_fraction`):

1. greedy references: each prompt decoded by the same service with the target alone (draft
   length 0), one at a time, before any load;
2. a warm-up of short requests at twice the concurrency (`warmup_s`), so that thread pools and
   allocators reach their working size; then every Serve replica process's threads, open file
   descriptors and RSS are read;
3. the load: `concurrency` streams for `duration_s`, each sending its planned requests
   (`cluster.tools.soak.plan`, fixed by `seed`: long and short, greedy and seeded sampled,
   streams left midway, deadlines that pass, bad input) as a well-behaved client
   (`cluster.tools.soak.clients`: refusals with a retry hint are retried after it), while a
   replica of each side in turn is SIGKILLed every `kill_interval_s` (`cluster.tools.faults`;
   Serve restarts it); progress every `PROGRESS_S` on stderr;
4. `settle_s` after the last request, every live replica's sessions and KV blocks in use (the
   registry), the processes again, the engine counters, failovers and degraded requests
   (`cluster.tools.soak.probes`);
5. the service stopped (`tandem shutdown`), and its Ray processes counted after it;
6. the table (`cluster.tools.soak.report`), on stdout and with everything measured in
   `--json FILE`; exit status 1 when a must-be row fails.

Ctrl-C or SIGTERM at any point stops the streams and the service, and says whether any of its
processes had to be signalled after `tandem shutdown`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cluster.api.client import TandemClient
from cluster.runtime.errors import InvalidArgumentError, TandemError
from cluster.tools import cleanup, faults
from cluster.tools.soak import probes as soak_probes
from cluster.tools.soak.clients import LOST_AFTER_S, run_stream
from cluster.tools.soak.outcomes import Tally
from cluster.tools.soak.plan import (
    NUM_DRAFTERS,
    NUM_VERIFIERS,
    RequestSpec,
    SoakSettings,
    VerifierPool,
    kill_plan,
    service_config,
    stream_requests,
    verifier_pool,
    warmup_requests,
)
from cluster.tools.soak.registry import RegistryWatch
from cluster.tools.soak.report import Findings, failed, format_table, rows
from cluster.tools.soak.service import PrivateService

PROGRESS_S = 5.0
REPLICAS_TIMEOUT_S = 120.0
"""How long the soak waits for every replica to be live (at the start, and after the load for
one killed near its end)."""
METRICS_LAG_S = 12.0
"""Ray's metrics agent exports what a process recorded every 10 s: the router's counters are
read this long after the last request."""
RETRY_GRACE_S = 30.0
"""A refused request retries until this long after the load's end, then counts as failed."""
JOIN_TIMEOUT_S = LOST_AFTER_S + 30.0
EXPECTED = {"drafter": NUM_DRAFTERS, "verifier": NUM_VERIFIERS, "suffix": 1}
"""Replicas of each side the soak's service runs (one suffix drafter, the default)."""

Say = Callable[[str], None]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `tandem soak` and `python -m cluster.tools.soak.run`."""
    d = SoakSettings()
    parser.add_argument(
        "--duration",
        type=float,
        default=d.duration_s,
        help=f"seconds of load (default {d.duration_s:.0f})",
    )
    parser.add_argument("--seed", type=int, default=d.seed, help="fixes the schedule")
    parser.add_argument("--concurrency", type=int, default=d.concurrency, help="client streams")
    parser.add_argument(
        "--kill-interval",
        type=float,
        default=d.kill_interval_s,
        help="SIGKILL a replica every this many seconds, sides alternating; 0 none",
    )
    parser.add_argument(
        "--drafter-error-fraction",
        type=float,
        default=d.drafter_error_fraction,
        help="share of Draft calls one drafter answers INTERNAL on purpose",
    )
    parser.add_argument(
        "--kv-long-requests",
        type=int,
        default=d.kv_long_requests,
        help="long requests the verifiers' KV pools hold together",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=d.warmup_s,
        help="seconds of short requests before the processes are first read",
    )
    parser.add_argument("--json", dest="json_out", metavar="FILE",
                        help="write the table and everything measured here")  # fmt: skip


def settings_from(args: argparse.Namespace) -> SoakSettings:
    return SoakSettings(
        duration_s=args.duration,
        seed=args.seed,
        concurrency=args.concurrency,
        kill_interval_s=args.kill_interval,
        drafter_error_fraction=args.drafter_error_fraction,
        kv_long_requests=args.kv_long_requests,
        warmup_s=args.warmup,
    )


def say_on_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_soak(settings: SoakSettings, json_out: str | None = None, say: Say = say_on_stderr) -> int:
    """Run the whole soak; print the table; returns the exit status (1: a row failed)."""
    run = SoakRun(settings, say)
    try:
        with cleanup.signals_raise():
            run.prepare()
            findings = run.measure()
    finally:
        with cleanup.signals_held():
            left = run.stop()
    findings.ray_processes_left = left
    table = rows(findings)
    result = {
        "home": str(run.home) if run.home is not None else None,
        "settings": dataclasses.asdict(settings),
        "pool": dataclasses.asdict(run.pool) if run.pool is not None else None,
        "seconds": run.seconds,
        "passed": not failed(table),
        "rows": [dataclasses.asdict(row) for row in table],
        "findings": findings.to_dict(),
    }
    if json_out:
        Path(json_out).write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(table), flush=True)
    return 1 if failed(table) else 0


class SoakRun:
    """One soak: its service, streams and readings (see the module's docstring)."""

    def __init__(self, settings: SoakSettings, say: Say) -> None:
        self.settings = settings
        self._say = say
        self._started = time.monotonic()
        self.seconds: dict[str, float] = {}
        self.pool: VerifierPool | None = None
        self._prompts: list[str] = []
        self._service: PrivateService | None = None
        self._client: TandemClient | None = None
        self._stop = threading.Event()
        self._counters = soak_probes.EngineCounters()
        self._registry: RegistryWatch | None = None

    @property
    def home(self) -> Path | None:
        """The service's TANDEM_HOME (removed once the soak stopped it)."""
        return self._service.home if self._service is not None else None

    def _note(self, message: str) -> None:
        self._say(f"[{time.monotonic() - self._started:7.1f}s] {message}")

    def _lap(self, name: str, since: float) -> None:
        self.seconds[name] = round(time.monotonic() - since, 1)

    def prepare(self) -> None:
        """Size the verifier pool from the target's KV bytes per token, and start the service."""
        from cluster.config import TandemConfig
        from cluster.presets import DEFAULT_PRESET, resolve_pair
        from cluster.replica.load import kv_cache_bytes_per_token
        from cluster.runtime.models import load_model
        from cluster.tools.prompt_files import load_prompts

        began = time.monotonic()
        self._prompts = [p.text for p in load_prompts(None)]
        target = load_model(resolve_pair(DEFAULT_PRESET, dtype="float32").target)
        lengths = [len(target.tokenizer.encode(p, add_special_tokens=False)) for p in self._prompts]
        block_size = TandemConfig().verifier_limits.kv_block_size
        self.pool = verifier_pool(
            kv_cache_bytes_per_token(target.model), block_size, lengths, self.settings
        )
        del target
        self._service = PrivateService(service_config(self.settings, self.pool, DEFAULT_PRESET))
        self._note(
            f"starting the service in {self._service.home} (tiny pair, fp32, "
            f"{NUM_DRAFTERS} drafters, {NUM_VERIFIERS} verifiers with "
            f"{self.pool.kv_cache_bytes} bytes of KV each: ~{self.pool.long_requests_per_pool} "
            f"long requests; takes a minute)"
        )
        self._service.start()
        self._client = TandemClient(self._service.address, api_key=self._service.api_key)
        self._registry = RegistryWatch(self._service.env)
        self._wait_for_replicas()
        self._lap("start", began)

    def measure(self) -> Findings:
        """References, warm-up, load and the readings after it (steps 1 to 4 of the module's
        docstring), on the service `prepare` started."""
        assert self._service is not None and self._client is not None
        began = time.monotonic()
        references = {
            i: self._client.generate(
                prompt, max_tokens=self.settings.long_tokens[1], draft_tokens=0,
                timeout_s=LOST_AFTER_S,
            ).tokens
            for i, prompt in enumerate(self._prompts)
        }  # fmt: skip
        self._lap("references", began)
        self._note(f"greedy references of {len(references)} prompts, target alone, in "
                   f"{self.seconds['references']:.1f} s")  # fmt: skip
        warmup = Tally()
        if self.settings.warmup_s > 0:
            self._streams("warm-up", 2 * self.settings.concurrency, warmup_requests,
                          self.settings.warmup_s, references, warmup)  # fmt: skip
        state = self._service.state()
        app_name = state.app_name or "tandem"
        start = soak_probes.usage_of(
            soak_probes.serve_replica_processes(self._service.temp_dir, app_name)
        )
        tally = Tally()
        kills: list[dict[str, Any]] = []
        drained = self._streams("load", self.settings.concurrency, stream_requests,
                                self.settings.duration_s, references, tally, kills)  # fmt: skip
        time.sleep(self.settings.settle_s)
        replicas = self._wait_for_replicas()
        settled_s = time.monotonic() - drained
        self._counters.observe(replicas)
        end = soak_probes.usage_of(
            soak_probes.serve_replica_processes(self._service.temp_dir, app_name)
        )
        time.sleep(max(0.0, drained + METRICS_LAG_S - time.monotonic()))
        return Findings(
            requests=tally.to_dict(),
            replicas=replicas,
            expected_replicas=sum(EXPECTED.values()),
            settle_s=settled_s,
            engine_counters=self._counters.totals(),
            failovers=soak_probes.failovers_in_logs(self._service.log_dir),
            degraded=soak_probes.scrape_degraded(state.metrics_port),
            processes_start=start,
            processes_end=end,
            warmup=warmup.to_dict(),
            kills=kills,
            growth_tolerance=self.settings.growth_tolerance,
        )

    def _streams(
        self,
        phase: str,
        concurrency: int,
        plan: Callable[[SoakSettings, int, int], Iterator[RequestSpec]],
        duration_s: float,
        references: dict[int, tuple[int, ...]],
        tally: Tally,
        kills: list[dict[str, Any]] | None = None,
    ) -> float:
        """Run `concurrency` streams of `plan` for `duration_s` (and the kills, if `kills` is
        given), saying how it goes; returns when the last request ended."""
        assert self._client is not None
        began = time.monotonic()
        load_ends = began + duration_s
        retry_until = load_ends + RETRY_GRACE_S
        threads = [
            threading.Thread(
                target=run_stream,
                args=(self._client, plan(self.settings, stream, len(self._prompts)),
                      self._prompts, references, tally, load_ends, retry_until, self._stop),
                name=f"soak-{phase}-{stream}", daemon=True,
            )
            for stream in range(concurrency)
        ]  # fmt: skip
        if kills is not None:
            threads.append(threading.Thread(target=self._kill, args=(began, kills),
                                            name="soak-kills", daemon=True))  # fmt: skip
        for thread in threads:
            thread.start()
        self._note(f"{phase}: {concurrency} streams for {duration_s:.0f} s")
        deadline = load_ends + JOIN_TIMEOUT_S
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            tick = time.monotonic() + PROGRESS_S
            for thread in threads:
                thread.join(max(0.0, tick - time.monotonic()))
            self._progress(phase, began, duration_s, tally, kills)
        if any(t.is_alive() for t in threads):
            raise TandemError(
                f"{phase}: streams still running {JOIN_TIMEOUT_S:.0f} s after the end"
            )
        self._lap(phase, began)
        return time.monotonic()

    def _progress(
        self,
        phase: str,
        began: float,
        duration_s: float,
        tally: Tally,
        kills: list[dict[str, Any]] | None,
    ) -> None:
        assert self._registry is not None
        # A registry between restarts is read again at the next tick.
        with contextlib.suppress(TandemError):
            self._counters.observe(self._registry.replicas(after=0.0, timeout_s=1.0))
        seen = tally.to_dict()
        elapsed = min(time.monotonic() - began, duration_s)
        failures = ", ".join(f"{code} {n}" for code, n in sorted(seen["failed"].items()))
        self._note(
            f"{phase} {elapsed:.0f}/{duration_s:.0f} s: {seen['requests']} requests done, "
            f"{sum(seen['failed'].values())} failed{f' ({failures})' if failures else ''}, "
            f"{sum(seen['own_errors'].values())} their own errors, "
            f"{seen['refusals_retried']} refusals retried, "
            f"{seen['greedy_mismatches']} greedy mismatches"
            + (f", {len(kills)} replicas killed" if kills is not None else "")
        )

    def _kill(self, began: float, log: list[dict[str, Any]]) -> None:
        for kill in kill_plan(self.settings.duration_s, self.settings.kill_interval_s):
            if self._stop.wait(max(0.0, began + kill.at_s - time.monotonic())):
                return
            before = len(log)
            assert self._registry is not None
            try:
                faults.kill_busiest(kill.side, self._registry.replicas, log)()
            except (TandemError, OSError) as error:
                log.append({"side": kill.side, "error": str(error)})
            for entry in log[before:]:
                entry["at_s"] = round(time.monotonic() - began, 1)
                self._note(f"killed {entry['side']} {entry.get('replica_id', '')} "
                           f"(pid {entry.get('pid', '-')}, {entry.get('sessions', 0)} sessions)"
                           if "pid" in entry else f"no kill: {entry['error']}")  # fmt: skip

    def _wait_for_replicas(self) -> list[dict[str, Any]]:
        """The registry's live replicas once each side has all of its own (or after
        `REPLICAS_TIMEOUT_S`: what is there then)."""
        assert self._registry is not None
        deadline = time.monotonic() + REPLICAS_TIMEOUT_S
        while True:  # each reading is a fresh one, about a second apart
            left_s = max(1.0, deadline - time.monotonic())
            replicas = self._registry.replicas(timeout_s=left_s)
            counts = {side: sum(r["side"] == side for r in replicas) for side in EXPECTED}
            if counts == EXPECTED or time.monotonic() > deadline:
                return replicas

    def stop(self) -> int | None:
        """Stop the streams and the service; the count of its processes `tandem shutdown` left
        (None if no service was started)."""
        self._stop.set()
        if self._client is not None:
            self._client.close()
        if self._registry is not None:
            self._registry.close()  # a Ray driver: `tandem shutdown` would stop it otherwise
        left = None
        if self._service is not None:
            self._note(f"stopping the service in {self._service.home}")
            left = self._service.stop()
            self._note(f"stopped; {left} of its processes were left after tandem shutdown")
        return left


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_soak(settings_from(args), args.json_out)
    except InvalidArgumentError as error:
        print(f"soak: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
