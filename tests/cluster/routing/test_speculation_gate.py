"""The router's speculation gate: alternates, compares and keeps the mode that commits more."""

from __future__ import annotations

from cluster.routing.speculation_gate import SPECULATE, TARGET, GateConfig, SpeculationGate


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_epoch(gate: SpeculationGate, clock: Clock, rates: dict[str, int]) -> str:
    """One epoch of 4 s: tokens committed at the rate of the mode the gate allows."""
    mode = SPECULATE if gate.speculate() else TARGET
    for _ in range(4):
        clock.now += 1.0
        gate.committed(rates[mode])
    return mode


def test_the_faster_mode_is_kept_then_measured_again() -> None:
    clock = Clock()
    gate = SpeculationGate(GateConfig(epoch_s=4.0, exploit_epochs=3), clock)
    for _ in range(4):
        gate.request_started()
    rates = {SPECULATE: 20, TARGET: 30}
    modes = [run_epoch(gate, clock, rates) for _ in range(8)]
    # Explore speculation, explore the target alone, exploit the target 3 epochs, explore.
    assert modes[:5] == [SPECULATE, TARGET, TARGET, TARGET, TARGET]
    assert modes[5:7] == [SPECULATE, TARGET]
    assert gate.choice == TARGET
    rates = {SPECULATE: 40, TARGET: 30}  # the text turned repetitive: speculation pays again
    modes = [run_epoch(gate, clock, rates) for _ in range(7)]
    # The rest of the exploitation, a new exploration, then speculation kept.
    assert modes == [TARGET, TARGET, SPECULATE, TARGET, SPECULATE, SPECULATE, SPECULATE]
    assert gate.choice == SPECULATE


def test_one_request_always_speculates() -> None:
    clock = Clock()
    gate = SpeculationGate(GateConfig(epoch_s=4.0), clock)
    gate.request_started()
    modes = [run_epoch(gate, clock, {SPECULATE: 5, TARGET: 50}) for _ in range(6)]
    assert modes == [SPECULATE] * 6


def test_epochs_under_different_loads_are_not_compared() -> None:
    clock = Clock()
    gate = SpeculationGate(GateConfig(epoch_s=4.0), clock)
    for _ in range(8):
        gate.request_started()
    run_epoch(gate, clock, {SPECULATE: 10, TARGET: 50})  # 8 requests
    for _ in range(6):
        gate.request_ended()  # 2 left: the target's epoch runs at a quarter of the load
    run_epoch(gate, clock, {SPECULATE: 10, TARGET: 50})
    assert gate.choice is None  # no verdict from epochs that are not alike
    assert gate.speculate()  # and measuring starts over


def test_a_disabled_gate_never_closes() -> None:
    clock = Clock()
    gate = SpeculationGate(GateConfig(enabled=False, epoch_s=1.0), clock)
    for _ in range(4):
        gate.request_started()
    assert all(run_epoch(gate, clock, {SPECULATE: 1, TARGET: 99}) == SPECULATE for _ in range(6))


def test_it_holds_the_target_only_in_a_target_epoch_of_two_or_more_requests() -> None:
    clock = Clock()
    gate = SpeculationGate(GateConfig(epoch_s=4.0, exploit_epochs=3), clock)
    gate.request_started()
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
