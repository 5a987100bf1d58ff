"""A request stops speculating where drafting costs more than it saves, on its own measurement,
and its output stays the target's own (`cluster.routing.draft_modes`); a drafter that reports
a start-up step 10x the verifier's has the draft model turned off before any round.

Drafting here costs what the plan's model does not see, as on a machine where the drafter and
the verifier share the cores: every verify pass of a drafted block is slowed by
`CONTENTION_S` (the verifier's work beside the drafter's), while a target-alone pass is not.
The plan prices a target-alone round with the verify passes it timed, all of them slowed, so
it keeps drafting (the control shows it); the measured modes see the target alone commit more
and stop. The router runs lockstep rounds, so that each round's pace is the verifier's call.
Counted in calls and tokens, not timed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.local import InProcess, LocalTandem, build_local, text_decoder
from cluster.presets import resolve_pair
from cluster.routing.directory import share_cores, step_costs
from cluster.routing.draft_length_config import DraftLengthConfig
from cluster.routing.draft_modes import MODEL, ModesConfig
from cluster.routing.generation import runs_in_lockstep, starting_modes
from cluster.routing.ports import Pinned, StepCosts
from cluster.routing.request import GenerationRequest
from cluster.routing.router import Router
from cluster.runtime.engine_stats import EngineStats
from cluster.wire.replica_info import ReplicaInfo

CONTENTION_S = 0.05
MAX_TOKENS = 96


class CountedDrafter:
    """The drafter, its draft calls counted."""

    def __init__(self, drafter: Any) -> None:
        self._drafter = drafter
        self.drafts = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._drafter, name)

    def submit_draft(self, *args: Any) -> Any:
        self.drafts += 1
        return self._drafter.submit_draft(*args)


class ContendedVerifier:
    """The verifier, every pass over a drafted block slowed by `CONTENTION_S`."""

    def __init__(self, verifier: Any) -> None:
        self._verifier = verifier

    def __getattr__(self, name: str) -> Any:
        return getattr(self._verifier, name)

    def submit_verify(self, session_id: str, block: Any, defer_bonus: bool) -> Any:
        if block.tokens:
            time.sleep(CONTENTION_S)
        return self._verifier.submit_verify(session_id, block, defer_bonus)


@pytest.fixture(scope="module")
def tiny() -> Iterator[LocalTandem]:
    tandem = build_local(resolve_pair("tiny"))
    yield tandem
    tandem.verifier.close()
    tandem.drafter.close()


def test_a_drafter_that_costs_more_than_it_saves_is_dropped_and_the_output_kept(
    tiny: LocalTandem,
) -> None:
    decode = text_decoder(tiny.tokenizer)
    prompt = tuple(tiny.tokenizer.encode("def add(a, b):"))
    request = GenerationRequest(prompt, MAX_TOKENS, draft_tokens=4, ignore_eos=True)
    alone = Router(InProcess(tiny.verifier), None, decode, tiny.target.eos_token_ids)
    reference = alone.generate(GenerationRequest(prompt, MAX_TOKENS, ignore_eos=True)).tokens
    drafter = CountedDrafter(tiny.drafter)

    def router(measured: bool) -> Router:
        config = DraftLengthConfig(enabled=True, speculation_gate=False, measured_modes=measured)
        return Router(
            InProcess(ContendedVerifier(tiny.verifier)),
            InProcess(drafter),
            decode,
            tiny.target.eos_token_ids,
            draft_length=config,
            verifier_advances=False,
        )

    result = router(measured=True).generate(request)
    assert result.tokens == reference
    stats = result.stats
    assert stats.draft_mode != MODEL, stats.draft_mode_reason
    # Bounded: one trial of the model's rounds (a call per round at most, each committing at
    # least one token), then no retry within this request (it lost by far more than 96 / 32).
    assert 0 < drafter.drafts <= ModesConfig().trial_tokens
    # Control: the plan alone, fooled by the slowed passes, keeps drafting.
    drafter.drafts = 0
    assert router(measured=False).generate(request).tokens == reference
    assert drafter.drafts > 2 * ModesConfig().trial_tokens


def engine(step_s: float) -> dict[str, Any]:
    return EngineStats(startup_base_s=step_s, startup_per_token_s=0.0).to_dict()


def test_a_replica_reporting_a_ten_times_slower_draft_turns_model_drafting_off() -> None:
    verifier = ReplicaInfo("v", "verifier", "a:1", 0, 0, engine=engine(0.02))
    fast = ReplicaInfo("d", "drafter", "a:2", 0, 0, engine=engine(0.002))
    slow = ReplicaInfo("d", "drafter", "a:2", 0, 0, engine=engine(0.2))
    config = DraftLengthConfig(enabled=True)
    assert starting_modes(config, 4, step_costs(verifier, fast)).mode == MODEL
    costs = step_costs(verifier, slow)
    assert costs is not None and costs.draft_ratio == pytest.approx(10.0)
    modes = starting_modes(config, 4, costs)
    assert modes.mode != MODEL and "10.00 of a target step" in modes.reason
    # Not measured (an older replica, or no engine): nothing is assumed.
    assert step_costs(verifier, ReplicaInfo("d", "drafter", "a:2", 0, 0)) is None
    assert step_costs(verifier, None) is None


def replica(side: str, step_s: float, node: str = "n1", runner: str = "paged",
            resources: dict[str, float] | None = None) -> ReplicaInfo:  # fmt: skip
    stats = EngineStats(runner=runner, startup_base_s=step_s, startup_per_token_s=0.0)
    return ReplicaInfo(side[0], side, "a:1", 0, 0, engine=stats.to_dict(), node_id=node,
                       resources=resources or {})  # fmt: skip


def test_replicas_share_cores_on_one_node_without_a_gpu_or_a_simulated_device() -> None:
    verifier = replica("verifier", 0.3)
    assert share_cores(verifier, replica("drafter", 0.06))
    assert not share_cores(verifier, replica("drafter", 0.06, node="n2"))
    assert not share_cores(verifier, replica("drafter", 0.06, runner="sim"))
    assert not share_cores(
        replica("verifier", 0.3, resources={"GPU": 1.0}), replica("drafter", 0.06)
    )
    costs = step_costs(verifier, replica("drafter", 0.06))
    assert costs is not None and costs.shared_cores


def test_a_request_drafting_with_a_model_on_shared_cores_runs_in_lockstep() -> None:
    config = DraftLengthConfig(enabled=True)
    verifier = replica("verifier", 0.3)
    shared = step_costs(verifier, replica("drafter", 0.06))
    apart = step_costs(verifier, replica("drafter", 0.06, node="n2"))
    slow = step_costs(verifier, replica("drafter", 3.0))  # the draft model starts off
    assert runs_in_lockstep(shared, starting_modes(config, 4, shared), speculates=True)
    assert not runs_in_lockstep(shared, starting_modes(config, 4, shared), speculates=False)
    assert not runs_in_lockstep(apart, starting_modes(config, 4, apart), speculates=True)
    assert not runs_in_lockstep(slow, starting_modes(config, 4, slow), speculates=True)
    assert not runs_in_lockstep(None, starting_modes(config, 4, None), speculates=True)


class CostedReplicas:
    """The in-process pair, pinned with the given start-up step costs."""

    def __init__(self, tandem: LocalTandem, costs: StepCosts) -> None:
        self.opened: list[Any] = []
        self._verifier = OpenRecorder(InProcess(tandem.verifier), self.opened)
        self._drafter = InProcess(tandem.drafter)
        self._costs = costs

    def pin(self, speculate: bool, deadline: float | None = None, tenant: str = "",
            suffix: bool = True) -> Pinned:  # fmt: skip
        drafter = self._drafter if speculate else None
        return Pinned(self._verifier, drafter, step_costs=self._costs if speculate else None)

    def spare(self, side: str, avoid: frozenset[str], deadline: float | None = None) -> None:
        return None


class OpenRecorder:
    """A verifier port that records the `advance` each session is opened with."""

    def __init__(self, port: Any, opened: list[Any]) -> None:
        self._port, self._opened = port, opened

    def __getattr__(self, name: str) -> Any:
        return getattr(self._port, name)

    def open_session(self, *args: Any, **kwargs: Any) -> Any:
        self._opened.append(kwargs.get("advance"))
        return self._port.open_session(*args, **kwargs)


@pytest.mark.parametrize("shared", [True, False])
def test_the_router_opens_a_lockstep_session_where_the_draft_shares_the_cores(
    tiny: LocalTandem, shared: bool
) -> None:
    costs = StepCosts(0.002, 0.0, 0.02, 0.0, shared_cores=shared)
    replicas = CostedReplicas(tiny, costs)
    router = Router.over_pool(
        replicas, text_decoder(tiny.tokenizer), tiny.target.eos_token_ids,
        draft_length=DraftLengthConfig(enabled=True, speculation_gate=False),
    )  # fmt: skip
    prompt = tuple(tiny.tokenizer.encode("def add(a, b):"))
    reference = router.generate(GenerationRequest(prompt, 24, draft_tokens=0, ignore_eos=True))
    result = router.generate(GenerationRequest(prompt, 24, draft_tokens=4, ignore_eos=True))
    assert result.tokens == reference.tokens
    alone_advance, speculative_advance = replicas.opened
    assert alone_advance is not None  # the target alone's session always runs
    assert (speculative_advance is None) == shared
    if shared:
        assert result.stats.model_drafted > 0  # in lockstep, the draft model's blocks verified
        assert result.stats.draft_mode_reason.endswith("lockstep rounds: the draft shares the "
                                                       "target's cores")  # fmt: skip
    else:
        assert "lockstep" not in result.stats.draft_mode_reason
