"""The replica traffic arithmetic (`cluster.tools.bench.replica_traffic`): counters read before
and after a window become frames, entries and results per generated token, per side."""

from __future__ import annotations

import pytest

from cluster.tools.bench.replica_traffic import traffic_line, traffic_per_token


def counters(side: int, frames_in: int, entries: int, frames_out: int, results: int,
             steps: int, running: int = 0, stepped: int = 0) -> dict[str, int]:  # fmt: skip
    return {"side": side, "frames_received": frames_in, "entries_received": entries,
            "frames_sent": frames_out, "results_sent": results, "steps": steps,
            "running_sessions": running, "running_stepped": stepped}  # fmt: skip


def test_growth_per_token_by_side_with_replicas_that_came_and_went() -> None:
    before = {
        "v1": counters(1, 10, 100, 10, 100, 10),
        "d1": counters(0, 5, 5, 5, 5, 50),
        "gone": counters(1, 1000, 1000, 1000, 1000, 1000),  # killed: left out after
    }
    after = {
        "v1": counters(1, 60, 740, 60, 740, 60),
        "v2": counters(1, 40, 60, 40, 60, 40),  # new: counts from 0
        "d1": counters(0, 5, 5, 5, 5, 50),
    }
    figures = traffic_per_token(before, after, tokens=800)
    verifier = figures["verifier"]
    assert verifier["frames_received_per_token"] == pytest.approx(90 / 800)
    assert verifier["entries_received_per_token"] == pytest.approx(700 / 800)
    assert verifier["results_per_frame"] == pytest.approx(700 / 90)
    assert verifier["frames_sent_per_step"] == pytest.approx(1.0)
    assert figures["drafter"]["frames_sent_per_token"] == 0
    assert figures["drafter"]["results_per_frame"] is None  # nothing sent
    assert "verifier frames/token in 0.113 out 0.113" in traffic_line(figures)


def test_step_occupancy_is_the_share_of_running_sessions_the_steps_carried() -> None:
    """Two verifiers over the window: 60 steps carried 950 of the 1,000 session-steps running
    (4 steps of 64 in which 12 sessions waited, say, then 56 of 12): 0.95; per step 16.7
    running, 15.8 carried."""
    before = {"v1": counters(1, 0, 0, 0, 0, 100, 5000, 4000), "v2": counters(1, 0, 0, 0, 0, 0)}
    after = {
        "v1": counters(1, 0, 0, 0, 0, 140, 5800, 4760),
        "v2": counters(1, 0, 0, 0, 0, 20, 200, 190),
    }
    figures = traffic_per_token(before, after, tokens=1000)["verifier"]
    assert figures["occupancy"] == pytest.approx(950 / 1000)
    assert figures["running_per_step"] == pytest.approx(1000 / 60)
    assert figures["stepped_per_step"] == pytest.approx(950 / 60)
    assert traffic_per_token(before, after, tokens=1000)["drafter"]["occupancy"] is None


def test_no_tokens_gives_no_figures() -> None:
    figures = traffic_per_token({}, {"v": counters(1, 1, 1, 1, 1, 1)}, tokens=0)
    assert figures["verifier"]["frames_sent_per_token"] is None
    assert traffic_line(figures) == "no replica traffic read"
