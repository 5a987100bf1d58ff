"""`tandem soak`: its pure parts (the plan, whose fault an ending is, the table's verdicts, each
able to fail), its client over a fake service, its probes, and the soak itself for two minutes
on a service of its own."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from cluster.api.client_types import StreamChunk, TandemClientError
from cluster.cli.main import main as tandem_main
from cluster.runtime.errors import InvalidArgumentError
from cluster.serve.ray_cluster import cluster_processes
from cluster.tools.soak import probes as soak_probes
from cluster.tools.soak.clients import run_request, run_stream
from cluster.tools.soak.outcomes import (
    Judgement,
    RequestOutcome,
    Tally,
    differs,
    failure_kind,
    judge,
)
from cluster.tools.soak.plan import (
    BAD_INPUTS,
    Ending,
    RequestSpec,
    SoakSettings,
    kill_plan,
    service_config,
    stream_requests,
    verifier_pool,
    warmup_requests,
)
from cluster.tools.soak.report import FAIL, INFO, PASS, Findings, failed, format_table, rows
from tests.cluster.conftest import TANDEM

SETTINGS = SoakSettings()


def first(specs: Iterator[RequestSpec], count: int) -> list[RequestSpec]:
    return list(itertools.islice(specs, count))


# The plan.


def test_a_seed_fixes_every_stream_and_streams_differ() -> None:
    one = first(stream_requests(SETTINGS, 3, 9), 200)
    assert one == first(stream_requests(SETTINGS, 3, 9), 200)
    assert one != first(stream_requests(SETTINGS, 4, 9), 200)
    assert one != first(stream_requests(replace(SETTINGS, seed=1), 3, 9), 200)
    assert [spec.index for spec in one] == list(range(200))
    assert first(warmup_requests(SETTINGS, 0, 9), 50) == first(warmup_requests(SETTINGS, 0, 9), 50)


def test_the_plan_mixes_every_kind_of_request() -> None:
    specs = [
        spec for stream in range(16) for spec in first(stream_requests(SETTINGS, stream, 9), 60)
    ]
    assert {spec.ending for spec in specs} == set(Ending)
    assert {spec.prompt for spec in specs} == set(range(9))
    lengths = [spec.max_tokens for spec in specs if spec.ending is Ending.COMPLETE]
    assert min(lengths) <= SETTINGS.short_tokens[1] and max(lengths) >= SETTINGS.long_tokens[0]
    assert any(s.greedy for s in specs) and any(s.seed is not None for s in specs)
    for spec in specs:
        assert (spec.seed is None) == (spec.temperature == 0.0)
        if spec.ending is Ending.DISCONNECT:
            assert 1 <= spec.disconnect_after <= spec.max_tokens
        if spec.ending is Ending.DEADLINE:
            low, high = SETTINGS.deadline_s
            assert spec.timeout_s is not None and low <= spec.timeout_s <= high
        else:
            assert spec.timeout_s is None
        if spec.ending is Ending.BAD_INPUT:
            assert spec.bad_input in BAD_INPUTS and not spec.greedy
            assert spec.settings().items() >= spec.bad_input.items()
    warmup = first(warmup_requests(SETTINGS, 0, 9), 100)
    assert all(s.ending is Ending.COMPLETE and s.max_tokens <= 32 for s in warmup)


def test_kills_alternate_sides_and_stop_half_an_interval_before_the_end() -> None:
    ten_minutes = kill_plan(600, 60)
    assert [k.at_s for k in ten_minutes] == [60 * i for i in range(1, 10)]
    assert [k.side for k in ten_minutes[:3]] == ["verifier", "drafter", "verifier"]
    assert [(k.at_s, k.side) for k in kill_plan(120, 60)] == [(60, "verifier")]
    assert [(k.at_s, k.side) for k in kill_plan(120, 40)] == [(40, "verifier"), (80, "drafter")]
    assert kill_plan(600, 0) == []


def test_the_verifier_pool_holds_its_share_of_long_requests_and_the_streams_overflow_it() -> None:
    prompts = [60, 124, 93, 199, 84, 71, 60, 44, 90]  # the default prompt set, in tokens
    pool = verifier_pool(1024, 16, prompts, SETTINGS)
    # Mean prompt 92 + 200 tokens + a block and its bonus (33) = 325 tokens: 21 blocks.
    assert pool.long_request_blocks == 21
    assert pool.long_requests_per_pool == SETTINGS.kv_long_requests // 2
    assert pool.kv_cache_bytes == 4 * 21 * 16 * 1024
    # The longest prompt with the longest request fits the context, in whole blocks.
    assert pool.max_context_tokens == 432 >= max(prompts) + SETTINGS.long_tokens[1]
    assert pool.kv_cache_bytes >= pool.max_context_tokens * 1024  # the pool's floor
    assert SETTINGS.concurrency / 2 > pool.long_requests_per_pool  # 16 streams overflow it
    config = service_config(SETTINGS, pool, "tiny")
    assert config["verifier_limits"]["kv_cache_bytes"] == pool.kv_cache_bytes
    assert config["drafter_limits"]["error_fraction"] == SETTINGS.drafter_error_fraction
    assert config["models"]["dtype"] == "float32"


@pytest.mark.parametrize(
    "changes",
    [
        {"duration_s": 0},
        {"concurrency": 0},
        {"kill_interval_s": -1},
        {"drafter_error_fraction": 1.5},
        {"kv_long_requests": 0},
        {"warmup_s": float("nan")},
        {"short_tokens": (0, 8)},
        {"long_tokens": (200, 100)},
        {"growth_tolerance": 2.0},
        {"deadline_s": (0.0, 1.0)},
    ],
)
def test_bad_settings_are_refused(changes: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        SoakSettings(**changes)


def test_bad_flags_exit_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert tandem_main(["soak", "--duration", "0"]) == 2
    assert "duration must be in" in capsys.readouterr().err


# Whose fault an ending is, and greedy outputs.


def spec(ending: Ending, **changes: Any) -> RequestSpec:
    return RequestSpec(**{"stream": 0, "index": 0, "prompt": 0, "max_tokens": 4,
                          "ending": ending, **changes})  # fmt: skip


DONE = RequestOutcome(tokens=(1, 2, 3, 4), finished=True)


@pytest.mark.parametrize(
    ("ending", "outcome", "expected"),
    [
        (Ending.COMPLETE, DONE, Judgement.OK),
        (Ending.COMPLETE, RequestOutcome((), False, "UNAVAILABLE"), Judgement.FAILED),
        (Ending.COMPLETE, RequestOutcome((1,), False, "DEADLINE_EXCEEDED"), Judgement.FAILED),
        (Ending.DEADLINE, RequestOutcome((1,), False, "DEADLINE_EXCEEDED"), Judgement.OWN_ERROR),
        (Ending.DEADLINE, DONE, Judgement.OK),
        (Ending.DEADLINE, RequestOutcome((1,), False, "RESOURCE_EXHAUSTED"), Judgement.FAILED),
        (Ending.DISCONNECT, RequestOutcome((1,), False, closed_early=True), Judgement.OK),
        (Ending.DISCONNECT, RequestOutcome((1,), False, "CANCELLED"), Judgement.FAILED),
        (Ending.BAD_INPUT, RequestOutcome((), False, "INVALID_ARGUMENT"), Judgement.OWN_ERROR),
        (Ending.BAD_INPUT, DONE, Judgement.FAILED),
        (Ending.BAD_INPUT, RequestOutcome((), False, "INTERNAL"), Judgement.FAILED),
    ],
)
def test_whose_fault_an_ending_is(
    ending: Ending, outcome: RequestOutcome, expected: Judgement
) -> None:
    assert judge(spec(ending), outcome) is expected


def test_resource_exhausted_failures_say_which() -> None:
    assert failure_kind(RequestOutcome((1,), False, "RESOURCE_EXHAUSTED")).endswith("mid-request")
    assert failure_kind(RequestOutcome((), False, "RESOURCE_EXHAUSTED")).endswith("no retry hint")
    hinted = RequestOutcome((), False, "RESOURCE_EXHAUSTED", retry_hint=True)
    assert failure_kind(hinted).endswith("to the end")
    assert failure_kind(RequestOutcome((), False, "UNAVAILABLE")) == "UNAVAILABLE"


def test_greedy_tokens_must_be_the_target_alones_whole_or_as_far_as_they_came() -> None:
    reference = (1, 2, 3, 4, 5, 6)
    greedy = spec(Ending.COMPLETE)
    assert not differs(greedy, DONE, reference)  # the first max_tokens (4) of the reference
    assert differs(greedy, RequestOutcome((1, 2, 3, 9), True), reference)
    assert differs(greedy, RequestOutcome((1, 2, 3), True), reference)  # finished too soon
    assert not differs(greedy, RequestOutcome((1, 2), False, "DEADLINE_EXCEEDED"), reference)
    assert differs(greedy, RequestOutcome((1, 7), False, closed_early=True), reference)
    sampled = spec(Ending.COMPLETE, temperature=0.8, seed=1)
    assert not differs(sampled, RequestOutcome((9, 9, 9, 9), True), reference)
    assert not differs(greedy, RequestOutcome((9,), True), None)  # no reference: not compared


def test_the_tally_counts_each_ending_once() -> None:
    tally = Tally()
    reference = (1, 2, 3, 4)
    tally.add(spec(Ending.COMPLETE), DONE, reference)
    tally.add(spec(Ending.COMPLETE), RequestOutcome((1, 9, 3, 4), True, refusals=2), reference)
    tally.add(spec(Ending.DEADLINE), RequestOutcome((1,), False, "DEADLINE_EXCEEDED"), reference)
    tally.add(spec(Ending.COMPLETE), RequestOutcome((), False, "UNAVAILABLE", "gone"), reference)
    seen = tally.to_dict()
    assert (seen["requests"], seen["tokens"], seen["refusals_retried"]) == (4, 9, 2)
    assert seen["failed"] == {"UNAVAILABLE": 1} and seen["failure_examples"]["UNAVAILABLE"] == [
        "gone"
    ]
    assert seen["own_errors"] == {"DEADLINE_EXCEEDED": 1}
    assert (seen["greedy_compared"], seen["greedy_mismatches"]) == (4, 1)
    assert seen["by_ending"] == {"complete failed": 1, "complete ok": 2, "deadline own_error": 1}


# The client, over a fake service.


class FakeClient:
    """Answers each stream call with the next of `answers`: a list of token chunks, or an
    error raised before (`(error, [])`) or after some chunks (`(error, chunks)`)."""

    def __init__(self, answers: list[Any]) -> None:
        self.answers = list(answers)
        self.calls: list[dict[str, Any]] = []
        self.closed = 0

    def stream(self, prompt: str, **settings: Any) -> Iterator[StreamChunk]:
        self.calls.append(settings)
        answer = self.answers.pop(0)
        error, chunks = answer if isinstance(answer, tuple) else (None, answer)

        def chunks_then_error() -> Iterator[StreamChunk]:
            try:
                for i, tokens in enumerate(chunks):
                    last = error is None and i == len(chunks) - 1
                    yield StreamChunk("r", tuple(tokens), "", "length" if last else None)
                if error is not None:
                    raise error
            finally:
                self.closed += 1

        return chunks_then_error()


def refused(hint: float | None) -> TandemClientError:
    return TandemClientError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", hint)


NEVER = threading.Event()


def test_a_refusal_with_a_retry_hint_is_retried_after_it() -> None:
    client = FakeClient([(refused(0.01), []), (refused(0.01), []), [[1, 2], [3, 4]]])
    outcome = run_request(client, spec(Ending.COMPLETE), "p", float("inf"), NEVER)
    assert outcome == RequestOutcome((1, 2, 3, 4), True, refusals=2)
    assert client.calls[0]["timeout_s"] > 60  # the lost-request bound, not a deadline of its own


def test_refusals_without_a_hint_mid_request_or_past_the_retry_window_fail() -> None:
    no_hint = run_request(FakeClient([(refused(None), [])]), spec(Ending.COMPLETE), "p", 1e9, NEVER)
    assert (no_hint.error, no_hint.refusals, no_hint.retry_hint) == ("RESOURCE_EXHAUSTED", 0, False)
    midway = run_request(
        FakeClient([(refused(0.01), [[1]])]), spec(Ending.COMPLETE), "p", 1e9, NEVER
    )
    assert (midway.error, midway.tokens, midway.refusals) == ("RESOURCE_EXHAUSTED", (1,), 0)
    late = run_request(FakeClient([(refused(5.0), [])]), spec(Ending.COMPLETE), "p", 0.0, NEVER)
    assert (late.error, late.retry_hint) == ("RESOURCE_EXHAUSTED", True)


def test_a_disconnecting_client_closes_its_stream_after_its_tokens() -> None:
    client = FakeClient([[[1], [2, 3], [4], [5]]])
    leaving = spec(Ending.DISCONNECT, disconnect_after=3)
    outcome = run_request(client, leaving, "p", 1e9, NEVER)
    assert outcome == RequestOutcome((1, 2, 3), False, closed_early=True)
    assert client.closed == 1


def test_a_deadline_request_sends_its_deadline() -> None:
    client = FakeClient([(TandemClientError(grpc.StatusCode.DEADLINE_EXCEEDED, "late"), [[1]])])
    outcome = run_request(client, spec(Ending.DEADLINE, timeout_s=0.5), "p", 1e9, NEVER)
    assert client.calls[0]["timeout_s"] == 0.5
    assert judge(spec(Ending.DEADLINE), outcome) is Judgement.OWN_ERROR


def test_a_stream_sends_its_plan_until_the_load_ends() -> None:
    now = [0.0]
    client = FakeClient([[[1]], [[2]], [[3]], [[4]]])
    tally = Tally()
    specs = iter([spec(Ending.COMPLETE, max_tokens=1) for _ in range(4)])

    def clock() -> float:
        now[0] += 1.0  # each look at the clock is a second later
        return now[0]

    run_stream(client, specs, ["p"], {0: (1, 2)}, tally, 2.5, 10.0, NEVER, clock)
    assert tally.requests == 2 and tally.mismatches == 1  # 1 = reference[:1]; 2 is not


# The table.


def passing() -> Findings:
    replica = {"num_sessions": 0, "engine": {"kv_blocks_used": 0, "preemptions": 3}}
    usage = {"deployment": "Verifier", "threads": 50, "fds": 60, "rss_mib": 500.0}
    return Findings(
        requests={"requests": 10, "failed": {}, "greedy_compared": 4, "greedy_mismatches": 0},
        replicas=[{"replica_id": f"r{i}", "side": "verifier", **replica} for i in range(4)],
        expected_replicas=4,
        settle_s=5.0,
        engine_counters={"preemptions": 3, "recomputed_tokens": None, "refusals": 0},
        failovers={"verifier UNAVAILABLE": 2},
        degraded={},
        processes_start={"11": usage, "12": usage},
        processes_end={"11": {**usage, "threads": 55}, "13": usage},
        ray_processes_left=0,
        kills=[{"side": "verifier", "at_s": 60.0, "pid": 12}],
    )


def test_a_clean_run_passes_and_says_what_it_counted() -> None:
    table = rows(passing())
    assert not failed(table)
    assert [row.verdict for row in table] == [PASS, PASS, PASS, PASS, INFO, PASS, PASS, INFO]
    text = format_table(table)
    assert text.rstrip().endswith("soak passed")
    assert "preemptions 3; recomputed tokens not reported" in text
    assert "failovers 2 (verifier UNAVAILABLE 2)" in text
    assert "1 lived through (verifier 11); 1 killed and restarted" in text


def test_a_suffix_drafter_has_no_kv_cache_but_must_hold_no_session() -> None:
    """The suffix replica reports no engine: the KV row reads the others; sessions read all."""
    suffix = {"replica_id": "s0", "side": "suffix", "num_sessions": 0, "engine": None}
    findings = passing()
    findings = replace(findings, replicas=[*findings.replicas, suffix], expected_replicas=5)
    table = rows(findings)
    assert not failed(table)
    assert "0 on 4 of 4 replicas with a KV cache" in format_table(table)
    held = replace(findings, replicas=[*findings.replicas[:4], {**suffix, "num_sessions": 1}])
    assert [row.figure for row in rows(held) if row.verdict == FAIL] == [
        "sessions open on every replica"
    ]


def replicas(sessions: int, kv_blocks: int | None, count: int = 4) -> list[dict[str, Any]]:
    engine = None if kv_blocks is None else {"kv_blocks_used": kv_blocks}
    return [{"replica_id": f"r{i}", "num_sessions": sessions, "engine": engine}
            for i in range(count)]  # fmt: skip


def ended(threads: int, rss_mib: float) -> dict[str, dict[str, Any]]:
    return {"11": {"deployment": "Verifier", "threads": threads, "fds": 60, "rss_mib": rss_mib}}


LOST = ("requests lost",)
GREEDY = ("greedy outputs",)
USAGE = ("threads, open",)


@pytest.mark.parametrize(
    ("changes", "figures"),
    [
        ({"requests": {"requests": 10, "failed": {"UNAVAILABLE": 1}, "greedy_compared": 4}}, LOST),
        ({"requests": {"requests": 0, "failed": {}, "greedy_compared": 4}}, LOST),
        ({"requests": {"requests": 10, "failed": {}, "greedy_compared": 4,
                       "greedy_mismatches": 1}}, GREEDY),
        ({"requests": {"requests": 10, "failed": {}, "greedy_compared": 0}}, GREEDY),
        ({"replicas": replicas(0, 2)}, ("KV blocks",)),
        ({"replicas": replicas(0, None)}, ("KV blocks",)),
        ({"replicas": replicas(1, 0)}, ("sessions open",)),
        ({"replicas": replicas(0, 0, count=3)}, ("KV blocks", "sessions open")),
        ({"processes_end": ended(threads=56, rss_mib=500.0)}, USAGE),  # 12% more threads
        ({"processes_end": ended(threads=50, rss_mib=551.0)}, USAGE),
        ({"processes_end": {}}, USAGE),  # nothing lived through: nothing compared
        ({"ray_processes_left": 2}, ("Ray processes",)),
        ({"ray_processes_left": None}, ("Ray processes",)),
    ],
)  # fmt: skip
def test_every_must_be_row_can_fail(changes: dict[str, Any], figures: tuple[str, ...]) -> None:
    table = rows(replace(passing(), **changes))
    failing = [row.figure for row in table if row.verdict == FAIL]
    assert len(failing) == len(figures), failing
    assert all(row.startswith(figure) for row, figure in zip(failing, figures, strict=True))
    assert failed(table) and format_table(table).rstrip().split("\n")[-1].startswith("FAIL: ")


# The probes.


def test_a_process_usage_reads_proc() -> None:
    usage = soak_probes.process_usage(os.getpid())
    assert usage is not None and usage.threads >= 1 and usage.fds >= 3 and usage.rss_mib > 10
    assert soak_probes.process_usage(2**22 + 1) is None  # past pid_max: no such process


def test_failovers_are_counted_once_by_side_and_cause(tmp_path: Path) -> None:
    lines = (
        "request a1: verifier v-1 failed: verifier at 127.0.0.1:1: UNAVAILABLE: Socket closed\n"
        "request a2: drafter d-1 failed: drafter at 127.0.0.1:2: INTERNAL: failed on purpose\n"
        "request a3: verifier v-2 failed: replica KV memory is full: a session of 9 tokens\n"
        "INFO something else failed: no\n"
    )
    (tmp_path / "worker-1.err").write_text(lines)
    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / "replica_tandem_Router_x.log").write_text("INFO " + lines)
    (tmp_path / "other.bin").write_text(lines)  # not a log file
    assert soak_probes.failovers_in_logs(tmp_path) == {
        "verifier UNAVAILABLE": 1, "drafter INTERNAL": 1, "verifier kv_full": 1,
    }  # fmt: skip


def test_engine_counters_keep_every_replicas_last_reading() -> None:
    counters = soak_probes.EngineCounters()
    counters.observe([{"replica_id": "a", "engine": {"preemptions": 1, "refusals": 2}},
                      {"replica_id": "b", "engine": {"preemptions": 5}}])  # fmt: skip
    counters.observe([{"replica_id": "a", "engine": {"preemptions": 4, "refusals": 2}}])  # b died
    assert counters.totals() == {"preemptions": 9, "recomputed_tokens": None, "refusals": 2}
    assert counters.replicas_seen == 2


# The soak itself.

# About 4.5 minutes alone on 2 cores (a minute and a half to start the service, 2 of load, 30 s
# to stop); beside the other xdist worker's clusters the start alone can take twice that.
SOAK_BUDGET_S = 720
STOP_GRACE_S = 90  # what a SIGTERMed soak has to stop its service


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(SOAK_BUDGET_S + STOP_GRACE_S + 30)
def test_a_two_minute_soak_passes(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_HOME"}
    cmd = [TANDEM, "soak", "--duration", "120", "--kill-interval", "40", "--json", str(out)]
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=SOAK_BUDGET_S)
        except subprocess.TimeoutExpired:
            proc.terminate()  # the soak stops the service it started, then exits
            stdout, stderr = proc.communicate(timeout=STOP_GRACE_S)
            pytest.fail(f"the soak ran past {SOAK_BUDGET_S} s; its log:\n{stderr[-4000:]}")
    soak = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    print(soak.stdout)
    result = json.loads(out.read_text())
    # Nothing of its service is left, whatever the table says.
    assert cluster_processes(result["home"] + "/ray") == [], result["home"]
    assert [k["side"] for k in result["findings"]["kills"]] == ["verifier", "drafter"]
    assert result["findings"]["failovers"].get("drafter INTERNAL", 0) > 0  # the erring drafter
    assert soak.returncode == 0 and result["passed"], soak.stdout + soak.stderr[-3000:]
