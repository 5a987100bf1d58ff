"""The audit: `cluster.runtime.audit` (reports), `cluster.tools.audit.stats` (the chi-square
mode) and `tandem audit` end to end, with its negative controls (a verifier broken on purpose,
samples from the draft model alone) that it must catch."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import cluster.local
from cluster.api.service import TandemService
from cluster.api.tenants import Tenants
from cluster.cli.main import main
from cluster.local import LocalTandem
from cluster.routing.request import GenerationRequest
from cluster.routing.router import Router
from cluster.runtime.audit import (
    NEAR_TIE_GAP,
    AuditReport,
    Replay,
    cause,
    compare,
    render_table,
    report_json,
    summarize,
)
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling import logits_to_probs
from cluster.runtime.sampling_params import SamplingParams
from cluster.tools.audit.stats import END, first_two_test
from tests.cluster.broken_verifiers import AcceptAllVerifier
from tests.cluster.grpc_front import serve_local

ALPHA = 1e-3
NUM_SAMPLES = 300
PROMPT = tuple(b"def add(a, b):")
SAMPLED = SamplingParams(temperature=1.0, seed_exact=True)
BASE = ["audit", "--preset", "tiny", "--max-tokens", "16", "--seeds", "1", "2"]

# ------------------------------------------------------------------------------- reports


def test_all_matched() -> None:
    report = compare([5, 6, 7], Replay((5, 6, 7), (1.0, 2.0, 3.0), "float32"), "greedy", "none")
    assert report.ok and cause(report) == "match"
    assert (report.matched, report.total, report.first_divergence, report.gap) == (3, 3, None, None)
    assert (report.rule, report.drafter, report.dtype) == ("greedy", "none", "float32")


def test_the_first_mismatch_and_its_evidence() -> None:
    near = NEAR_TIE_GAP / 10
    replay = Replay((5, 6, 7, 8), (1.0, near, 2.0, 0.5), "bfloat16", (0.0, near, 0.0, 0.0))
    report = compare([5, 9, 7, 8], replay, "seed_exact", "model")
    assert not report.ok and report.matched == 3 and report.total == 4
    assert (report.first_divergence, report.served_token, report.reference_token) == (1, 9, 6)
    assert report.gap == report.served_gap == report.worst_gap == near
    assert cause(report) == "near_tie"


def test_any_wide_mismatch_is_a_divergence() -> None:
    """A near-tie first does not excuse a later mismatch that no rounding explains."""
    replay = Replay((5, 6, 7), (0.01, 0.01, 0.02), "float32", (0.01, 0.0, 3.0))
    report = compare([4, 6, 1], replay, "greedy", "model")
    assert report.first_divergence == 0 and report.served_gap == 0.01
    assert report.worst_gap == 3.0 and cause(report) == "divergence"


def test_without_served_gaps_the_top_two_gap_judges() -> None:
    report = compare([4], Replay((5,), (2 * NEAR_TIE_GAP,), "float32"), "greedy", "x")
    assert report.served_gap == report.gap and cause(report) == "divergence"


def test_compare_refuses_what_does_not_fit() -> None:
    replay = Replay((5, 6), (1.0, 1.0), "float32")
    with pytest.raises(InvalidArgumentError, match="covers 2 tokens"):
        compare([5], replay, "greedy", "x")
    with pytest.raises(InvalidArgumentError, match="rule"):
        compare([5, 6], replay, "rejection", "x")


def _reports() -> list[AuditReport]:
    return [
        compare([1, 2], Replay((1, 2), (1.0, 1.0), "float32"), "greedy", "model"),
        compare([1, 3], Replay((1, 2), (1.0, 0.01), "float32", (0.0, 0.01)), "greedy", "model"),
        compare([4], Replay((1,), (0.5,), "float32", (math.inf,)), "seed_exact", "model"),
    ]


def test_summary_table_and_json() -> None:
    reports = _reports()
    summary = summarize(reports)
    assert (summary.requests, summary.matched_tokens, summary.total_tokens) == (3, 3, 5)
    assert dict(summary.by_cause) == {"match": 1, "near_tie": 1, "divergence": 1}
    assert not summary.ok
    table = render_table(reports, ["a", "b", "c"])
    assert table.splitlines()[0].split()[:2] == ["request", "rule"]
    assert "3/5 tokens matched (60.00%) over 3 requests: 1 match, 1 near_tie, 1 divergence" in table
    row = report_json(reports[2])
    assert row["served_gap"] == row["worst_gap"] == "inf"  # JSON has no infinity
    assert (row["ok"], row["cause"], row["served_token"], row["reference_token"]) == (
        False, "divergence", 4, 1,
    )  # fmt: skip
    json.dumps(row, allow_nan=False)
    with pytest.raises(InvalidArgumentError, match="labels"):
        render_table(reports, ["a"])


# ---------------------------------------------------------------------- statistical mode


def seed_exact_samples(router: Router) -> list[tuple[int, ...]]:
    """First two tokens of NUM_SAMPLES seed-exact requests through `router`, a lockstep one
    (`verifier_advances` off), so that drafted tokens decide both, the first round waiting
    for the drafter (the seeds make independent exact draws)."""
    return [
        router.generate(GenerationRequest(PROMPT, 3, SAMPLED, seed=seed, draft_tokens=2)).tokens[:2]
        for seed in range(NUM_SAMPLES)
    ]


def draft_samples(draft: LoadedModel) -> list[tuple[int, int]]:
    """NUM_SAMPLES (t1, t2) pairs drawn from the draft model alone: what a pipeline that emitted
    drafts unchecked would produce."""
    generator = torch.Generator().manual_seed(0)

    def next_probs(tokens: tuple[int, ...]) -> torch.Tensor:
        with torch.inference_mode():
            logits = draft.model(torch.tensor([tokens])).logits[:, -1]
        return logits_to_probs(logits.float(), SAMPLED)[0]

    firsts = torch.multinomial(next_probs(PROMPT), NUM_SAMPLES, True, generator=generator)
    rows = {t1: next_probs((*PROMPT, t1)) for t1 in set(firsts.tolist())}
    return [
        (t1, int(torch.multinomial(rows[t1], 1, generator=generator))) for t1 in firsts.tolist()
    ]


def test_router_samples_follow_the_target(lockstep: Router, tiny_target: LoadedModel) -> None:
    """The seeds are fixed, so this is deterministic; under a correct sampler the p-value is
    (asymptotically) uniform, so a correct pipeline fails it for a given set of seeds with
    probability ALPHA."""
    test = first_two_test(tiny_target, PROMPT, SAMPLED, seed_exact_samples(lockstep))
    assert test.passed(ALPHA), test
    assert test.num_samples == sum(test.observed) == NUM_SAMPLES and test.impossible == 0
    assert sum(test.expected) == pytest.approx(NUM_SAMPLES)
    assert min(test.expected) >= 5 and test.degrees_of_freedom == len(test.cells) - 1 >= 3


def test_draft_samples_fail(tiny_target: LoadedModel, tiny_draft: LoadedModel) -> None:
    """The negative control: the same test must reject the draft model's own distribution."""
    test = first_two_test(tiny_target, PROMPT, SAMPLED, draft_samples(tiny_draft))
    assert test.p_value < ALPHA, test


def test_an_impossible_sample_fails_outright(tiny_target: LoadedModel) -> None:
    narrow = SamplingParams(temperature=1.0, top_k=1)  # one token possible at each step
    with torch.inference_mode():
        t1 = int(tiny_target.model(torch.tensor([PROMPT])).logits[0, -1].argmax())
        t2 = int(tiny_target.model(torch.tensor([[*PROMPT, t1]])).logits[0, -1].argmax())
    good = first_two_test(tiny_target, PROMPT, narrow, [(t1, t2)] * 10)
    assert good.p_value == 1.0 and good.cells == ((t1, t2),)
    bad = first_two_test(tiny_target, PROMPT, narrow, [(t1, t2)] * 9 + [(t1, (t2 + 1) % 256)])
    assert bad.p_value == 0.0 and bad.impossible == 1


def test_statistical_input_errors(tiny_target: LoadedModel) -> None:
    with pytest.raises(InvalidArgumentError, match="token by token"):
        first_two_test(tiny_target, PROMPT, SamplingParams(), [(1, 2)])
    with pytest.raises(InvalidArgumentError, match="sample 1"):
        first_two_test(tiny_target, PROMPT, SAMPLED, [(1, 2), (3,)])
    eos = min(tiny_target.eos_token_ids)
    ended = first_two_test(tiny_target, PROMPT, SAMPLED, [(eos,), (1, 2)])
    assert ended.num_samples == 2 and (eos, END) not in ended.cells  # too rare for a cell


# ------------------------------------------------------------------------------- the CLI


def run_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path, *flags: str) -> tuple[int, Any]:
    out = tmp_path / "audit.json"
    code = main([*BASE, *flags, "--json", str(out)])
    capsys.readouterr()
    return code, json.loads(out.read_text())


def test_local_audit_matches_everything(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, result = run_cli(capsys, tmp_path, "--local")
    assert code == 0
    summary = result["summary"]
    assert summary["ok"] and summary["matched_tokens"] == summary["total_tokens"] > 0
    assert summary["requests"] == len(result["reports"]) == 4 * 3  # 4 prompts, 2 seeds + greedy
    rules = {(r["rule"], r["seed"]) for r in result["reports"]}
    assert rules == {("seed_exact", 1), ("seed_exact", 2), ("greedy", None)}
    assert all(r["dtype"] == "float32" and r["drafter"] == "model+prompt_lookup"
               for r in result["reports"])  # fmt: skip


def test_a_broken_verifier_is_caught(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The in-process service's verifier accepts every drafted token (`AcceptAllVerifier`): the
    audit must say so, with the evidence at the first wrong token."""
    monkeypatch.setattr(cluster.local, "Verifier", AcceptAllVerifier)
    code, result = run_cli(capsys, tmp_path, "--local")
    assert code == 1
    assert not result["summary"]["ok"]
    wrong = [r for r in result["reports"] if not r["ok"]]
    assert wrong and result["summary"]["by_cause"]["divergence"] >= 1
    for r in wrong:
        assert r["matched"] < r["total"] and r["first_divergence"] is not None
        assert r["served_token"] != r["reference_token"]
        assert isinstance(r["gap"], float) and r["served_gap"] in ("inf", r["served_gap"])


@pytest.fixture(scope="module")
def address(local_tandem: LocalTandem) -> Iterator[str]:
    service = TandemService(
        local_tandem.router, local_tandem.tokenizer, tenants=Tenants.unauthenticated()
    )
    server, port = serve_local(service)
    yield f"127.0.0.1:{port}"
    server.stop(None)


def test_remote_audit(address: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, result = run_cli(capsys, tmp_path, "--address", address)
    assert code == 0 and result["summary"]["ok"]
    assert {r["drafter"] for r in result["reports"]} == {"service"}


def test_statistical_cli(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unseeded requests draw fresh seeds, so this run is random: at alpha 1e-6 a correct
    pipeline fails it once in a million runs, while the broken one (every drafted token
    accepted, so both tokens are the draft model's) scored p < 1e-12 in every trial run."""
    flags = ["--local", "--statistical", "--samples", "200", "--temperature", "1.0"]
    flags += ["--prompt", bytes(PROMPT).decode(), "--alpha", "1e-6"]
    code, result = run_cli(capsys, tmp_path, *flags)
    assert code == 0 and result["passed"] and result["num_samples"] == 200
    monkeypatch.setattr(cluster.local, "Verifier", AcceptAllVerifier)
    code, result = run_cli(capsys, tmp_path, *flags)
    assert code == 1 and not result["passed"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--address", "127.0.0.1:1", "--draft", "tiny://draft"], "--draft cannot be used"),
        (["--local", "--temperature", "0"], "temperature > 0"),
        (["--local", "--max-tokens", "0"], "--max-tokens"),
        (["--local", "--prompt", "x"], "--prompt is for --statistical"),
        (["--local", "--dtype", "int4"], "dtype must be one of"),
    ],
)
def test_bad_flags_get_a_clear_error(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main([*BASE, *flags]) == 2
    assert message in capsys.readouterr().err
