"""The planning math on known cases: no speculation at alpha 0, long blocks for cheap accurate
drafts, the host's cores capping tokens/s, drafter load growing with load, and the closed
loop's two limits."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.plan.defaults import SIM_H100_8B
from cluster.plan.inputs import DrafterCost, HostCost, PlanInputs
from cluster.plan.model import (
    best_estimate,
    clients_per_verifier,
    closed_loop_rate,
    draft_step_profile,
    estimate,
    mixed_tokens_per_s,
)
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.sim_source import PROFILES, DeviceProfile

FREE_HOST = HostCost(usable_cores=1e6, cpu_ms_per_token=0.0)
"""A host that costs nothing: the plan is the device's ideal alone."""


def inputs(alpha: float, host: HostCost = FREE_HOST, **drafter: object) -> PlanInputs:
    model = DrafterCost(kind="model", placement="own_device", device=PROFILES["a10g-0.5b"])
    model = dataclasses.replace(model, **drafter)  # type: ignore[arg-type]
    return PlanInputs(
        name="test",
        target=PROFILES["h100-8b"],
        drafters={"model": model, "suffix": SIM_H100_8B.drafters["suffix"]},
        host=host,
        acceptance={"c": {"model": alpha}},
        context_tokens=128,
    )


def test_alpha_zero_never_speculates() -> None:
    for clients in (1, 16, 64):
        best = best_estimate(inputs(0.0), "c", clients)
        assert best.kind == "none" and best.draft_tokens == 0


def test_cheap_accurate_drafts_get_long_blocks() -> None:
    cheap = DeviceProfile(base_s=1e-5, per_token_s=0.0, per_context_s=0.0)
    long = best_estimate(inputs(0.98, device=cheap), "c", 1)
    assert long.kind == "model" and long.draft_tokens == 8
    # A costly, poor draft takes a short block, if any.
    short = best_estimate(inputs(0.5), "c", 1)
    assert short.draft_tokens <= 2


def test_free_host_matches_the_device_ideal() -> None:
    plan = estimate(inputs(0.8), "model", 0.8, 4, 16)
    assert plan.tokens_per_s == pytest.approx(plan.device_tokens_per_s, rel=1e-9)
    assert plan.itl_ms == pytest.approx(16 / plan.tokens_per_s * 1000)


def test_the_hosts_cores_cap_tokens_per_s() -> None:
    host = HostCost(usable_cores=2.0, cpu_ms_per_token=1.0)  # at most 2,000 tokens/s
    busy = estimate(inputs(0.8, host), "model", 0.8, 4, 256)
    free = estimate(inputs(0.8), "model", 0.8, 4, 256)
    assert free.tokens_per_s > 5_000
    assert 1_900 < busy.tokens_per_s <= 2_000
    # Near the cap (32 streams) speculation gains a fraction of a percent: not worth a drafter.
    alone = estimate(inputs(0.8, host), "none", 0.0, 0, 32)
    near = estimate(inputs(0.8, host), "model", 0.8, 4, 32)
    assert alone.tokens_per_s < near.tokens_per_s < 1.01 * alone.tokens_per_s
    assert best_estimate(inputs(0.8, host), "c", 32).kind == "none"


def test_closed_loop_limits() -> None:
    # One stream sees the delay plus its CPU; many tend to cores / CPU a token.
    assert closed_loop_rate(1, 0.004, 0.001, 2.0) == pytest.approx(1 / 0.005)
    assert closed_loop_rate(10_000, 0.004, 0.001, 2.0) == pytest.approx(2_000, rel=1e-3)
    rates = [closed_loop_rate(n, 0.004, 0.001, 2.0) for n in (1, 2, 8, 32, 128)]
    assert rates == sorted(rates)


def test_drafters_per_verifier_grow_with_load() -> None:
    suffix = [estimate(SIM_H100_8B, "suffix", 0.7, 4, n) for n in (1, 4, 16)]
    loads = [e.drafter_load for e in suffix]
    assert loads == sorted(loads) and loads[-1] > 3 * loads[0]
    assert estimate(SIM_H100_8B, "self-int4", 0.95, 4, 16).drafter_load == 0.0


def test_capacity_factor_only_for_a_draft_on_its_own_device() -> None:
    own = estimate(SIM_H100_8B, "model", 0.8, 4, 1)
    d, v = 4 * PROFILES["a10g-0.5b"].step_s(1, 124), PROFILES["h100-8b"].step_s(5, 124)
    assert own.capacity_factor == pytest.approx(1 + d / v)
    assert estimate(SIM_H100_8B, "self-int4", 0.95, 4, 1).capacity_factor is None


def test_self_drafting_shares_the_verifiers_device() -> None:
    target = PROFILES["h100-8b"]
    step = draft_step_profile(SIM_H100_8B.drafters["self-int4"], 4, target)
    ratio = SIM_H100_8B.drafters["self-int4"].target_ratio
    assert step.step_s(8, 100) == pytest.approx(ratio * target.step_s(8, 100))


def test_clients_per_verifier() -> None:
    plan = SIM_H100_8B
    one = estimate(plan, "model", 0.8, 4, 1).itl_ms
    assert clients_per_verifier(plan, "model", 0.8, 4, itl_ms=one / 2) == 0
    served = clients_per_verifier(plan, "model", 0.8, 4, itl_ms=20.0)
    assert estimate(plan, "model", 0.8, 4, served).itl_ms <= 20.0
    assert estimate(plan, "model", 0.8, 4, served + 1).itl_ms > 20.0
    assert clients_per_verifier(plan, "model", 0.8, 4) >= 1


def test_mixing_weights_tokens_equally() -> None:
    assert mixed_tokens_per_s([100.0, 300.0]) == pytest.approx(150.0)


@pytest.mark.parametrize(
    "call",
    [
        lambda: estimate(SIM_H100_8B, "model", 0.8, 4, 0),
        lambda: estimate(SIM_H100_8B, "model", 0.8, 4, 4, verifiers=0),
        lambda: estimate(SIM_H100_8B, "bogus", 0.8, 4, 4),
        lambda: best_estimate(SIM_H100_8B, "no-such-category", 4),
        lambda: clients_per_verifier(SIM_H100_8B, "model", 0.8, 4, itl_ms=0.0),
        lambda: HostCost(usable_cores=0.0, cpu_ms_per_token=1.0),
        lambda: HostCost(usable_cores=2.0, cpu_ms_per_token=-1.0),
        lambda: DrafterCost(kind="model", placement="own_device"),
        lambda: DrafterCost(kind="self-int4", placement="verifier_device", target_ratio=0.0),
        lambda: dataclasses.replace(SIM_H100_8B, acceptance={"c": {"model": 1.5}}),
        lambda: dataclasses.replace(SIM_H100_8B, acceptance={"c": {"mystery": 0.5}}),
    ],
)
def test_bad_inputs_are_invalid_arguments(call: object) -> None:
    with pytest.raises(InvalidArgumentError):
        call()  # type: ignore[operator]


def test_prefill_shares_the_device_with_the_rounds() -> None:
    # One stream on a free host: a token's device time grows by P x t_prefill / G exactly.
    plain = estimate(inputs(0.8), "none", 0.0, 0, 1)
    long = dataclasses.replace(inputs(0.8), prompt_tokens=1000, output_tokens=50)
    with_prefill = estimate(long, "none", 0.0, 0, 1)
    profile = PROFILES["h100-8b"]
    extra_s = (1000 * profile.per_token_s + 1000**2 * profile.per_context_s / 2) / 50
    assert 1 / with_prefill.tokens_per_s == pytest.approx(1 / plain.tokens_per_s + extra_s)
    # A draft on the verifier's device prefills the prompt too, at its cost ratio.
    self_draft = DrafterCost(kind="self-int4", placement="verifier_device", target_ratio=0.25)
    assert long.prefill_s_per_generated_token(self_draft) == pytest.approx(1.25 * extra_s)
    assert long.prefill_s_per_generated_token(long.drafters["model"]) == pytest.approx(extra_s)
    priced = dataclasses.replace(long, prefill_s_per_token=1e-3, prefill_s_per_token_squared=0)
    assert priced.prefill_s_per_generated_token(None) == pytest.approx(1000 * 1e-3 / 50)


def test_longer_rounds_share_a_rounds_cpu() -> None:
    host = HostCost(usable_cores=1.0, cpu_ms_per_token=0.5, cpu_ms_per_round=1.0, cpu_ms_per_step=8)
    assert host.cpu_ms(1) == pytest.approx(9.5)
    assert host.cpu_ms(16, tokens_per_round=3.0) == pytest.approx(0.5 + 1.5 / 3.0)
    # At the host's cap, speculation that commits more tokens a round is worth more tokens/s.
    capped = inputs(0.9, host)
    alone = estimate(capped, "none", 0.0, 0, 256)
    drafted = estimate(capped, "model", 0.9, 4, 256)
    assert alone.tokens_per_s == pytest.approx(1000 / host.cpu_ms(256), rel=0.02)
    assert drafted.tokens_per_s > 2 * alone.tokens_per_s


def test_off_path_cpu_loads_the_cores_but_not_the_round() -> None:
    # One stream: only the critical share delays it; many streams: every ms of CPU counts.
    assert closed_loop_rate(1, 0.004, 0.002, 2.0, 0.5) == pytest.approx(1 / 0.005, rel=1e-6)
    assert closed_loop_rate(10_000, 0.004, 0.002, 2.0, 0.5) == pytest.approx(1_000, rel=1e-3)
    shares = [closed_loop_rate(16, 0.004, 0.002, 2.0, s) for s in (1.0, 0.6, 0.2)]
    assert shares == sorted(shares)


def test_routers_per_verifier_keep_its_device_fed() -> None:
    """A router process gives 0.8 of a core: at 0.3 ms a token, 2,667 tokens/s each; a device
    committing 8,000 tokens/s needs 3.75 routers' worth (4), a drafting round's 1 ms over its
    4 tokens adds 0.25 ms a token."""
    from cluster.plan.inputs import RouterCost
    from cluster.plan.model import router_load

    cost = RouterCost(cpu_ms_per_token=0.3, cpu_ms_per_round=1.0, core_share=0.8)
    assert router_load(cost, 8000.0, None) == pytest.approx(3.0)
    assert router_load(cost, 8000.0, 4.0) == pytest.approx(8000 * 0.55e-3 / 0.8)
    assert router_load(cost, 0.0, None) == 0.0
