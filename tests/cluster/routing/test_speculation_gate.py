"""The router's speculation gate: alternates, compares and keeps the mode that commits more,
decides quickly under load, and remembers its choice per level of concurrency."""

from __future__ import annotations

from cluster.routing.speculation_gate import (
    SPECULATE,
    TARGET,
    GateConfig,
    SpeculationGate,
    _Choices,
    level_of,
)

FOUR_SECOND_EPOCHS = GateConfig(epoch_s=4.0, min_epoch_s=4.0, epoch_tokens=10**9, exploit_s=12.0)
"""Epochs of exactly 4 s whatever is committed; an exploitation lasts three of them."""


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_epoch(gate: SpeculationGate, clock: Clock, rates: dict[str, int], seconds: int = 4) -> str:
    """`seconds` of rounds, one a second, committing at the rate of the mode the gate allows
    at the epoch's start (the epoch's mode)."""
    mode = SPECULATE if gate.speculate() else TARGET
    for _ in range(seconds):
        clock.now += 1.0
        gate.committed(rates[mode])
    return mode


def gate_with(
    requests: int, config: GateConfig = FOUR_SECOND_EPOCHS
) -> tuple[SpeculationGate, Clock]:
    clock = Clock()
    gate = SpeculationGate(config, clock)
    for _ in range(requests):
        gate.request_started()
    return gate, clock


def test_the_faster_mode_is_kept_then_measured_again() -> None:
    gate, clock = gate_with(4)
    rates = {SPECULATE: 20, TARGET: 30}
    modes = [run_epoch(gate, clock, rates) for _ in range(7)]
    # Explore speculation, explore the target alone, exploit the target 3 epochs (12 s), then
    # explore again: the other mode first, then the choice.
    assert modes == [SPECULATE, TARGET, TARGET, TARGET, TARGET, SPECULATE, TARGET]
    assert gate.choice == TARGET
    rates = {SPECULATE: 40, TARGET: 30}  # the text turned repetitive: speculation pays again
    modes = [run_epoch(gate, clock, rates) for _ in range(11)]
    # The confirmed choice exploits twice as long (6 epochs), then a new exploration finds
    # speculation faster and keeps it.
    assert modes == [TARGET] * 6 + [SPECULATE, TARGET] + [SPECULATE] * 3
    assert gate.choice == SPECULATE


def test_a_confirmed_choice_doubles_its_exploitation_up_to_the_cap() -> None:
    config = GateConfig(epoch_s=4.0, min_epoch_s=4.0, epoch_tokens=10**9, exploit_s=4.0,
                        max_doublings=2)  # fmt: skip
    gate, clock = gate_with(4, config)
    modes = [run_epoch(gate, clock, {SPECULATE: 20, TARGET: 30}) for _ in range(20)]
    # Explorations (s t), each followed by the target exploited 1, 2, 4, then still 4 epochs.
    assert "".join(mode[0] for mode in modes) == "sttstttstttttsttttts"


def test_one_request_always_speculates() -> None:
    gate, clock = gate_with(1)
    modes = [run_epoch(gate, clock, {SPECULATE: 5, TARGET: 50}) for _ in range(6)]
    assert modes == [SPECULATE] * 6


def test_epochs_under_different_loads_are_not_compared() -> None:
    gate, clock = gate_with(8)
    run_epoch(gate, clock, {SPECULATE: 10, TARGET: 50})  # 8 requests
    for _ in range(6):
        gate.request_ended()  # 2 left: the target's epoch runs at a quarter of the load
    run_epoch(gate, clock, {SPECULATE: 10, TARGET: 50})
    assert gate.choice is None  # no verdict from epochs that are not alike
    assert gate.speculate()  # and measuring starts over


def test_a_disabled_gate_never_closes() -> None:
    gate, clock = gate_with(4, GateConfig(enabled=False, epoch_s=1.0))
    assert all(run_epoch(gate, clock, {SPECULATE: 1, TARGET: 99}) == SPECULATE for _ in range(6))


def test_it_holds_the_target_only_in_a_target_epoch_of_two_or_more_requests() -> None:
    gate, clock = gate_with(1)
    assert not gate.holds_target()  # one request: the per-request plan decides
    gate.request_started()
    held = []
    for _ in range(5):
        mode = run_epoch(gate, clock, {SPECULATE: 20, TARGET: 30})
        held.append(gate.holds_target())
    # Epochs: speculate, target, then target kept; asked at each epoch's end (the next mode).
    assert held == [True, True, True, True, False]
    assert mode == TARGET
    assert not SpeculationGate(GateConfig(enabled=False), clock).holds_target()


def test_under_load_an_epoch_ends_with_its_tokens_and_with_few_at_its_longest() -> None:
    config = GateConfig(epoch_s=4.0, min_epoch_s=1.0, epoch_tokens=500)
    busy, clock = gate_with(64, config)
    # 600 tokens a second: each epoch ends after its first second, so the gate has chosen
    # after two seconds and exploits from the third.
    modes = [run_epoch(busy, clock, {SPECULATE: 500, TARGET: 600}, seconds=1) for _ in range(3)]
    assert modes == [SPECULATE, TARGET, TARGET] and busy.choice == TARGET
    slow, clock = gate_with(4, config)
    # 20 tokens a second: an epoch lasts its longest, 4 s.
    modes = [run_epoch(slow, clock, {SPECULATE: 20, TARGET: 30}, seconds=1) for _ in range(9)]
    assert modes == [SPECULATE] * 4 + [TARGET] * 5 and slow.choice == TARGET


def test_a_known_level_is_exploited_at_once_and_the_target_carries_to_more_streams() -> None:
    gate, clock = gate_with(16)
    rates = {SPECULATE: 20, TARGET: 30}
    assert [run_epoch(gate, clock, rates) for _ in range(2)] == [SPECULATE, TARGET]
    assert gate.holds_target() and gate.choice == TARGET
    for _ in range(48):  # 64 streams: no speculation epoch, the target alone carries over
        gate.request_started()
    modes = [run_epoch(gate, clock, rates) for _ in range(5)]
    # The epoch that saw the load move was the target's; then 12 s of exploiting it (3 epochs)
    # before 64 streams are explored for themselves.
    assert modes == [TARGET] * 4 + [SPECULATE]
    for _ in range(62):  # 2 streams: a lower level, where a choice at 16 says nothing
        gate.request_ended()
    modes = [run_epoch(gate, clock, {SPECULATE: 30, TARGET: 20}) for _ in range(4)]
    # The speculation epoch under way ends at the load change; 2 streams are explored.
    assert modes[1:] == [SPECULATE, TARGET, SPECULATE]
    assert gate.choice == SPECULATE


def test_choices_carry_the_target_up_and_speculation_down() -> None:
    choices = _Choices({level_of(16): TARGET, level_of(2): SPECULATE})
    assert choices.known(16) == TARGET
    assert choices.known(64) == TARGET  # more streams than where the target won
    assert choices.known(1.5) == SPECULATE  # fewer than where speculation won
    assert choices.known(6) is None  # between: nothing carries
    assert _Choices().known(8) is None
    assert [level_of(c) for c in (2, 16, 22, 64)] == [2, 8, 9, 12]
