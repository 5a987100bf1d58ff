"""A request keeps the drafting that its own measured tokens per second says pays
(`cluster.routing.draft_modes`): never below the target alone, a loss bounded, the start-up
measurement obeyed. Pure: rates are fed, no clock."""

from __future__ import annotations

from cluster.routing.draft_length_config import DraftLengthConfig
from cluster.routing.draft_modes import ALONE, LOOKUP, MODEL, DraftModes, ModesConfig
from cluster.routing.generation import starting_modes
from cluster.routing.ports import StepCosts

SECONDS_PER_TOKEN = {MODEL: 0.5, LOOKUP: 0.2, ALONE: 0.3}
"""A host where the draft model loses, lookup wins and the target alone is in between."""


def run(modes: DraftModes, tokens: int, per_token_s: dict[str, float]) -> list[str]:
    """Commit `tokens` one at a time at each mode's pace; the mode of every token."""
    seen = []
    for _ in range(tokens):
        mode = modes.mode
        seen.append(mode)
        modes.observe(mode, 1, per_token_s[mode])
    return seen


def test_a_losing_draft_model_is_left_after_one_trial_and_the_best_mode_kept() -> None:
    modes = DraftModes()
    seen = run(modes, 200, SECONDS_PER_TOKEN)
    trial = ModesConfig().trial_tokens
    assert seen[:trial] == [MODEL] * trial
    assert seen[-100:].count(LOOKUP) > 80
    # Bounded loss: the model runs its first trial and retries at doubling waits only.
    assert seen.count(MODEL) <= 3 * trial
    assert seen.count(LOOKUP) > 0.75 * len(seen)
    assert modes.reason.startswith("lookup")


def test_where_nothing_beats_the_target_alone_it_is_kept() -> None:
    pace = {MODEL: 0.5, LOOKUP: 0.35, ALONE: 0.3}
    modes = DraftModes()
    seen = run(modes, 300, pace)
    assert seen[-100:].count(ALONE) > 80
    assert seen.count(ALONE) > 0.75 * len(seen)
    # Committed tokens per second over the whole request: within 10% of the target alone's.
    elapsed = sum(pace[m] for m in seen)
    assert len(seen) / elapsed > 0.9 / pace[ALONE]


def test_speculation_within_the_margin_of_the_target_alone_gives_way_to_it() -> None:
    # Lookup drafting nothing runs about as fast as the target alone: within the margin, the
    # target alone is kept; a clear gain keeps lookup.
    near = {MODEL: 0.5, LOOKUP: 0.29, ALONE: 0.3}  # 3% faster
    seen = run(DraftModes(ModesConfig(margin=0.0)), 300, near)
    assert seen[-100:].count(LOOKUP) > 80  # without a margin, lookup's 3% keeps it
    seen = run(DraftModes(), 300, near)
    assert seen[-100:].count(ALONE) > 80
    clear = {MODEL: 0.5, LOOKUP: 0.25, ALONE: 0.3}  # 20% faster
    seen = run(DraftModes(), 300, clear)
    assert seen[-100:].count(LOOKUP) > 80


def test_a_draft_model_that_pays_keeps_running() -> None:
    pace = {MODEL: 0.1, LOOKUP: 0.25, ALONE: 0.3}
    modes = DraftModes()
    modes.seed_alone(0.3)
    seen = run(modes, 200, pace)
    assert seen[-100:].count(MODEL) > 80
    assert seen.count(MODEL) > 0.8 * len(seen)


def test_a_change_of_pace_is_found_again() -> None:
    modes = DraftModes()
    seen = run(modes, 200, {MODEL: 0.1, LOOKUP: 0.25, ALONE: 0.3})
    assert seen[-100:].count(MODEL) > 80
    seen = run(modes, 400, {MODEL: 0.6, LOOKUP: 0.25, ALONE: 0.3})
    assert seen[-100:].count(LOOKUP) > 80


def test_the_start_up_measurement_turns_the_draft_model_off() -> None:
    config = DraftLengthConfig(enabled=True)
    fast = StepCosts(draft_base_s=0.001, draft_per_token_s=0.0, verify_base_s=0.02,
                     verify_per_token_s=0.0)  # fmt: skip
    slow = StepCosts(draft_base_s=0.2, draft_per_token_s=0.0, verify_base_s=0.02,
                     verify_per_token_s=0.0)  # fmt: skip
    assert starting_modes(config, 4, fast).mode == MODEL
    modes = starting_modes(config, 4, slow)  # a draft step 10x the target's
    assert modes.mode == LOOKUP
    assert "10.00 of a target step" in modes.reason
    # It stays off for the whole of an ordinary request, even where it would measure well.
    seen = run(modes, 300, {MODEL: 0.001, LOOKUP: 0.02, ALONE: 0.02})
    assert MODEL not in seen
    # Off with the adaptive plan, and for a request that asks for no speculation.
    assert starting_modes(DraftLengthConfig(enabled=False), 4, slow).mode == MODEL
    assert not starting_modes(DraftLengthConfig(enabled=False), 4, slow).config.enabled


def test_a_verify_pass_that_grows_with_its_block_turns_the_draft_model_off() -> None:
    # bfloat16 on a CPU without native bfloat16: k + 1 tokens cost about k + 1 steps.
    steep = StepCosts(draft_base_s=0.09, draft_per_token_s=0.0, verify_base_s=0.0,
                      verify_per_token_s=0.31)  # fmt: skip
    assert starting_modes(DraftLengthConfig(enabled=True), 4, steep).mode == LOOKUP


def test_disabled_modes_never_move() -> None:
    modes = DraftModes(ModesConfig(enabled=False))
    assert set(run(modes, 100, SECONDS_PER_TOKEN)) == {MODEL}


def test_suffix_blocks_are_cut_to_the_length_the_verify_passes_price() -> None:
    from cluster.routing.draft_length import DraftLength
    from cluster.runtime.draft_block import StepLoad

    def lengths(base_s: float, per_token_s: float) -> DraftLength:
        plan = DraftLength(DraftLengthConfig(enabled=True), 4, pipelined=False)
        load = StepLoad(batch_sequences=1, batch_tokens=1, cost_base_s=base_s,
                        cost_per_token_s=per_token_s)  # fmt: skip
        plan.observe_verify(base_s + per_token_s, load=load)
        return plan

    assert DraftLength(DraftLengthConfig(enabled=True), 4, False).paying_length(0.5, 32) == 32
    flat = lengths(0.02, 0.0001)  # a GPU's: tokens nearly free
    assert flat.paying_length(0.75, 32) >= 8
    assert flat.paying_length(0.97, 32) == 32
    steep = lengths(0.156, 0.155)  # bf16 on AVX2: 1, 2, 5 tokens 311, 466, 931 ms
    assert steep.paying_length(0.75, 32) == 1
    # Only a block accepted nearly whole is worth its steps, and then a longer one.
    assert 1 < steep.paying_length(0.999, 32) <= 32
