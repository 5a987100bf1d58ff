"""`tandem plan --check` pricing a load test's levels as they ran, and `--calibrate` fitting the
host term back from levels the plan itself predicted."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.plan.calibrate import calibrate, fit_cpu, fit_device
from cluster.plan.check import alpha_for_tokens, check_rows, drafting_share, priced_as_run
from cluster.plan.defaults import QWEN_CODER, SIM_H100_8B
from cluster.plan.inputs import HostCost
from cluster.plan.model import estimate
from cluster.plan.solve import golden_minimum, increasing_root, least_squares
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.sim import expected_tokens


def speculation(drafted: float, passes: float, suffix_share: float) -> dict[str, float]:
    tokens = 1000
    return {
        "num_drafted": drafted * tokens,
        "suffix_drafted": suffix_share * drafted * tokens,
        "drafted_per_token": drafted,
        "passes_per_token": passes,
    }


def test_a_level_is_priced_as_it_speculated() -> None:
    kind, k, alpha = priced_as_run(speculation(0.9, 0.12, 0.95))
    assert (kind, k) == ("suffix", 8)  # 7.5 drafted a pass
    assert expected_tokens(alpha, k) == pytest.approx(1 / 0.12, rel=1e-6)
    assert priced_as_run(speculation(0.75, 0.25, 0.1))[:2] == ("model", 3)
    # A gate that held the target alone: (almost) nothing drafted.
    assert priced_as_run(speculation(0.01, 1.0, 0.0)) == ("none", 0, 0.0)


def test_alpha_for_tokens_clamps() -> None:
    assert alpha_for_tokens(1.0, 4) == 0.0
    assert alpha_for_tokens(7.0, 4) == 1.0
    assert expected_tokens(alpha_for_tokens(3.0, 4), 4) == pytest.approx(3.0, rel=1e-6)


def test_fit_cpu_recovers_the_terms_and_keeps_them_non_negative() -> None:
    t, r, s = 0.3, 1.0, 6.0
    samples = [(n, e, t + (r + s / n) / e) for n in (4, 16, 64) for e in (1.0, 3.0, 8.0)]
    assert fit_cpu(samples) == pytest.approx((t, r, s), rel=1e-6)
    # A CPU that grows with the round's tokens has no non-negative fit of that shape but t.
    flat = fit_cpu([(16, 1.0, 1.0), (16, 8.0, 2.0)])
    assert min(flat) >= 0.0
    with pytest.raises(InvalidArgumentError):
        fit_cpu([(16, 1.0, 1.0)])


def test_golden_minimum() -> None:
    assert golden_minimum(lambda x: (x - 1.3) ** 2, 0.0, 4.0) == pytest.approx(1.3, abs=1e-6)


def host_cpu_lookups(tokens_per_round: float) -> float:
    return SIM_H100_8B.drafters["suffix"].cpu_ms_per_round / tokens_per_round


def test_calibration_recovers_a_host_from_its_own_predictions() -> None:
    truth = HostCost(
        usable_cores=1.7,
        cpu_ms_per_token=0.35,
        cpu_ms_per_round=1.0,
        cpu_ms_per_step=6.0,
        critical_share=0.5,
    )
    inputs = dataclasses.replace(SIM_H100_8B, host=truth)
    runs = {"target_only": ("none", 0.0, 0), "speculative": ("suffix", 0.97, 8)}
    levels = []
    for streams in (1, 16, 64):
        level: dict[str, object] = {"concurrency": streams}
        for mode, (kind, alpha, k) in runs.items():
            plan = estimate(inputs, kind, alpha, k, streams)
            # The suffix replica's lookups are measured apart (role `suffix`).
            lookups = host_cpu_lookups(plan.tokens_per_round) if kind != "none" else 0.0
            entry = {
                "tokens_per_s": plan.tokens_per_s,
                "cpu_ms_per_token": {"service_total": plan.cpu_ms_per_token, "suffix": lookups},
            }
            if kind != "none":
                tokens = plan.tokens_per_round
                entry["speculation"] = speculation(k / tokens, 1 / tokens, 1.0)
            level[mode] = entry
        levels.append(level)
    result = {"config": {"max_tokens": 64}, "sim": {"context_tokens": 124}, "levels": levels}
    fitted = calibrate(SIM_H100_8B, result, "agentic")
    assert fitted.target == SIM_H100_8B.target  # a modelled device is not refitted
    assert fitted.host.usable_cores == pytest.approx(1.7, rel=0.02)
    assert fitted.host.critical_share == pytest.approx(0.5, rel=0.05)
    for row in check_rows(fitted, result, "agentic"):
        assert row.ratio == pytest.approx(1.0, abs=0.02)


def test_a_device_on_the_host_is_refitted_from_itl_and_first_token() -> None:
    # A machine twice as slow as the shipped curve: steps of 2 (155 + 5.7 N) ms, and a
    # prefill three times the shipped one.
    inputs = dataclasses.replace(QWEN_CODER, prompt_tokens=400)
    step = lambda n: 2 * (0.155 + 5.7e-3 * n)  # noqa: E731
    prefill = 3 * inputs.prefill_s()
    levels = [
        {
            "concurrency": n,
            "target_only": {
                "tokens_per_s": n / step(n),
                "itl_ms": {"p50": 1e3 * step(n)},
                "ttft_ms": {"p50": 1e3 * (prefill + step(1))},
                "cpu_ms_per_token": {"service_total": 3.5 * n / n},
            },
        }
        for n in (1, 2, 8)
    ]
    fitted = fit_device(inputs, {"levels": levels})
    assert fitted.target.base_s == pytest.approx(0.31, rel=1e-6)
    assert fitted.target.per_token_s == pytest.approx(11.4e-3, rel=1e-6)
    assert fitted.prefill_s() == pytest.approx(prefill, rel=1e-6)
    with pytest.raises(InvalidArgumentError):
        fit_device(inputs, {"levels": levels[:1]})


def test_a_gate_that_drafted_in_few_rounds_costs_their_cpu_only() -> None:
    assert drafting_share(speculation(0.12, 0.97, 0.0), 1) == pytest.approx(0.12 / 0.97)
    assert drafting_share(speculation(0.9, 0.12, 1.0), 8) == pytest.approx(7.5 / 8)
    assert drafting_share(speculation(0.9, 0.12, 1.0), 7) == 1.0
    model = SIM_H100_8B.drafters["model"]
    few = estimate(SIM_H100_8B, "model", 0.05, 1, 16, drafting_share=0.1)
    every = estimate(SIM_H100_8B, "model", 0.05, 1, 16)
    extra = model.host_cpu_ms_per_round(1) / few.tokens_per_round
    assert every.cpu_ms_per_token - few.cpu_ms_per_token == pytest.approx(0.9 * extra)


def test_solvers() -> None:
    assert increasing_root(lambda x: x**3, 0.125) == pytest.approx(0.5, abs=1e-9)
    assert increasing_root(lambda x: x, 2.0) == pytest.approx(1.0)  # beyond the interval
    assert least_squares([[1.0, 1.0, 1.0], [1.0, 2.0, 3.0]], [3.0, 5.0, 7.0]) == pytest.approx(
        [1.0, 2.0]
    )
    assert least_squares([[1.0, 1.0], [2.0, 2.0]], [1.0, 2.0]) is None  # collinear
