"""The simulated device's profiles and presets: the 70B-class pair (`h200-70b` verified beside an
`h100-1b` draft, preset `sim-h200-70b`) parses, steps as its formula says and has a sane ideal;
every sim preset runs at the small vocabulary."""

from __future__ import annotations

import pytest
import torch

from cluster.presets import PRESETS, resolve_pair
from cluster.runtime import sim, sim_source
from cluster.runtime.block_runner import SequenceWork
from cluster.runtime.models import load_model
from cluster.runtime.sim_model import SimModelRunner

TARGET, DRAFT = sim_source.PROFILES["h200-70b"], sim_source.PROFILES["h100-1b"]


def test_the_70b_preset_parses_to_its_profiles() -> None:
    pair = resolve_pair("sim-h200-70b", device="cpu")
    target = sim_source.SimSource.parse(pair.target.source)
    draft = sim_source.SimSource.parse(pair.draft.source)
    assert (target.role, target.profile_name, target.vocab_size) == ("target", "h200-70b", 4096)
    assert (draft.role, draft.profile_name, draft.alpha, draft.vocab_size) == (
        "draft", "h100-1b", 0.8, 4096,
    )  # fmt: skip
    assert target.profile is TARGET and draft.profile is DRAFT
    assert TARGET.source and DRAFT.source


@pytest.mark.parametrize("name", [n for n in PRESETS if n.startswith("sim-")])
def test_every_sim_preset_runs_at_the_small_vocabulary(name: str) -> None:
    for spec in (PRESETS[name].target, PRESETS[name].draft):
        assert sim_source.SimSource.parse(spec).vocab_size == 4096


@pytest.mark.parametrize(
    ("tokens", "attended", "want_s"),
    [
        (1, 256, 16e-3 + 1.3e-4 + 256 * 3.4e-8),  # one stream decoding: ~16.1 ms
        (16, 16 * 256, 16e-3 + 16 * 1.3e-4 + 4096 * 3.4e-8),  # ~18.2 ms
        (320, 64 * 256, 16e-3 + 320 * 1.3e-4 + 16384 * 3.4e-8),  # 64 blocks of 5: ~58.2 ms
    ],
)
def test_the_70b_step_is_its_formula(tokens: int, attended: int, want_s: float) -> None:
    assert TARGET.step_s(tokens, attended) == pytest.approx(want_s)


def test_the_1b_draft_steps_far_cheaper_than_its_target() -> None:
    assert DRAFT.step_s(1, 256) == pytest.approx(1.5e-3 + 5e-6 + 256 * 1e-8)
    for streams in (1, 16, 64):
        attended = streams * 256
        assert DRAFT.step_s(streams, attended) < 0.15 * TARGET.step_s(streams, attended)


def test_the_70b_ideal_follows_the_formula() -> None:
    per_verify = (1 - 0.8**5) / (1 - 0.8)
    for streams in (1, 16, 64):
        rates = sim.ideal_rates(TARGET, DRAFT, alpha=0.8, k=4, streams=streams)
        attended = streams * 256
        assert rates.target_only == pytest.approx(streams / TARGET.step_s(streams, attended))
        serial_s = 4 * DRAFT.step_s(streams, attended) + TARGET.step_s(5 * streams, attended)
        assert rates.serial == pytest.approx(streams * per_verify / serial_s)
        assert rates.target_only < rates.serial <= rates.predrafted
        assert 1 <= rates.predraft_fan_out <= 8 and 0 < rates.predraft_hit <= 1
    # The figures docs/simulated-device.md gives, as the code computes them.
    figures = [
        (round(r.target_only), round(r.serial), round(r.pipelined), round(r.predrafted))
        for r in (sim.ideal_rates(TARGET, DRAFT, 0.8, 4, streams) for streams in (1, 16, 64))
    ]
    assert figures == [(62, 148, 146, 202), (878, 1629, 1555, 2027), (2573, 3255, 3006, 3699)]


def test_the_70b_models_load_and_the_runner_waits_the_modelled_time() -> None:
    pair = resolve_pair("sim-h200-70b", device="cpu")
    target = load_model(pair.target)
    logits = target.model(torch.tensor([[5, 9, 300]])).logits
    assert logits.shape == (1, 3, 4096) and logits.dtype == torch.float32
    slept: list[float] = []
    runner = SimModelRunner(
        target.model, num_blocks=16, block_size=16, sleep=slept.append, clock=lambda: 0.0
    )
    rows = runner.forward([SequenceWork("a", (5, 9, 300), (2,))])
    assert torch.equal(rows, logits[0, 2:])
    assert slept == pytest.approx([TARGET.step_s(3, 3)])
