"""Request deadlines: the router stops a request past its deadline and frees both sessions;
over gRPC, bounded clients stop calls when the time runs out, never call with none left, and
tell replicas the time left, so a replica drops the session on its own. The clients' calls yield
their waits (`cluster.routing.waits`), run here to their end with `run`; a verifier's block is
posted, its verdict (or the error) pushed to the request's events."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import pytest

from cluster.local import LocalTandem, local_router
from cluster.routing.directory import RegistryPool
from cluster.routing.grpc_drafter import GrpcDrafter
from cluster.routing.grpc_verifier import GrpcVerifier
from cluster.routing.request import GenerationRequest
from cluster.routing.router import Router
from cluster.routing.session_events import SessionEvents
from cluster.routing.waits import run
from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.errors import DeadlineExceededError, ReplicaUnavailableError
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling_params import SamplingParams
from cluster.wire.replica_info import ReplicaInfo
from drafter.drafter import Drafter
from tests.conftest import CODE_PROMPT, encode
from tests.replicas import serve_drafter, serve_verifier
from verifier.verifier import Verifier

PROMPT = [5, 6, 7, 8]
GREEDY = SamplingParams()
WAIT_S = 30.0
"""Upper bound on waits that end as soon as the awaited thing happens."""


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _assert_nothing_held(*components: Verifier | Drafter) -> None:
    for component in components:
        stats = component.stats()
        assert (stats.num_sessions, stats.num_cached_tokens) == (0, 0)


# --- the router ----------------------------------------------------------------------------------


def test_a_request_past_its_deadline_fails_and_holds_nothing(local_tandem: LocalTandem) -> None:
    request = GenerationRequest(
        encode(local_tandem, CODE_PROMPT), 20, draft_tokens=4, deadline=time.monotonic() - 1.0
    )
    with pytest.raises(DeadlineExceededError, match="deadline passed after 0 of its 20 tokens"):
        local_tandem.router.generate(request)
    _assert_nothing_held(local_tandem.verifier, local_tandem.drafter)


@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
def test_a_deadline_passing_mid_generation_stops_the_request_and_frees_both_sessions(
    local_tandem: LocalTandem, pipelined: bool
) -> None:
    clock = Clock()
    router = local_router(
        local_tandem.verifier,
        local_tandem.drafter,
        local_tandem.target,
        pipelined=pipelined,
        clock=clock,
    )
    request = GenerationRequest(
        encode(local_tandem, CODE_PROMPT), 40, draft_tokens=4, deadline=10.0
    )
    try:
        stream = router.stream(request)
        first = next(stream)
        second = next(stream)  # the drafter's session opened meanwhile
        assert first.tokens and second.tokens
        assert local_tandem.verifier.stats().num_sessions == 1
        clock.now = 10.0
        with pytest.raises(DeadlineExceededError, match="deadline passed after"):
            next(stream)
    finally:
        router.close()
    _assert_nothing_held(local_tandem.verifier, local_tandem.drafter)


# --- bounded gRPC clients ------------------------------------------------------------------------


@dataclass
class Served:
    """A verifier and a drafter behind loopback servers, and plain clients of each."""

    verifier: Verifier
    drafter: Drafter
    verifier_client: GrpcVerifier
    drafter_client: GrpcDrafter
    entries: list[dict[str, Any]]
    """Both replicas as the registry lists them."""

    def side(self, side: str) -> tuple[Verifier | Drafter, GrpcVerifier | GrpcDrafter]:
        """The component and the client of `side`."""
        if side == "verifier":
            return self.verifier, self.verifier_client
        return self.drafter, self.drafter_client


@pytest.fixture(scope="module")
def served(tiny_target: LoadedModel, tiny_draft: LoadedModel) -> Iterator[Served]:
    verifier, drafter = Verifier(tiny_target), Drafter(tiny_draft)
    verifier_server, verifier_port = serve_verifier(verifier)
    drafter_server, drafter_port = serve_drafter(drafter)
    verifier_client = GrpcVerifier(f"127.0.0.1:{verifier_port}", timeout_s=WAIT_S)
    drafter_client = GrpcDrafter(f"127.0.0.1:{drafter_port}", timeout_s=WAIT_S)
    entries = [
        ReplicaInfo("verifier-0", "verifier", f"127.0.0.1:{verifier_port}", 0, 0).to_dict(),
        ReplicaInfo("drafter-0", "drafter", f"127.0.0.1:{drafter_port}", 0, 0).to_dict(),
    ]
    yield Served(verifier, drafter, verifier_client, drafter_client, entries)
    verifier_client.close()
    drafter_client.close()
    verifier_server.stop(None)
    drafter_server.stop(None)
    _assert_nothing_held(verifier, drafter)


def _spy_open(monkeypatch: pytest.MonkeyPatch, component: Any) -> list[float | None]:
    """Record the `time_limit_s` of every session the component opens (`submit_open`, which
    a Frames entry's open goes through)."""
    limits: list[float | None] = []
    submit_open = component.submit_open

    def spy(*args: Any, time_limit_s: float | None = None, **kwargs: Any) -> Future[int]:
        limits.append(time_limit_s)
        return submit_open(*args, time_limit_s=time_limit_s, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(component, "submit_open", spy)
    return limits


def _wait_for(condition: Callable[[], bool]) -> bool:
    give_up = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > give_up:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("side", ["verifier", "drafter"])
def test_a_bounded_client_sends_the_time_left_and_the_replica_drops_the_session_itself(
    served: Served, monkeypatch: pytest.MonkeyPatch, side: str
) -> None:
    component, client = served.side(side)
    limits = _spy_open(monkeypatch, component)
    run(client.open_session("plain", PROMPT, GREEDY, 0))
    assert client.bounded(None) is client
    run(client.bounded(time.monotonic() + 2.0).open_session("bounded", PROMPT, GREEDY, 0))
    plain_limit, bounded_limit = limits
    assert plain_limit is None
    assert bounded_limit is not None and 0 < bounded_limit <= 2.0
    assert component.stats().num_sessions == 2
    # The router never closes it: the replica's own sweep drops it once its time is up.
    assert _wait_for(lambda: component.evict_idle() == 1)
    assert component.stats().num_sessions == 1
    assert run(client.close_session("plain"))
    assert not run(client.close_session("bounded"))


def test_a_bounded_client_with_no_time_left_never_calls_the_replica(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    for component in (served.verifier, served.drafter):
        methods = (
            "open_session",
            "verify",
            "draft",
            "submit_open",
            "submit_verify",
            "submit_draft",
        )
        for method in methods:
            if hasattr(component, method):
                monkeypatch.setattr(component, method, lambda *a, m=method, **k: calls.append(m))
    late = served.verifier_client.bounded(time.monotonic() - 0.001)
    with pytest.raises(DeadlineExceededError, match="deadline passed before its call"):
        run(late.open_session("s", PROMPT, GREEDY, 0))
    with pytest.raises(DeadlineExceededError):
        run(served.drafter_client.bounded(time.monotonic() - 0.001).draft("s", 4, [], 1))
    # A post is fire and forget: the error is its answer, in the request's events.
    events = SessionEvents()
    late.post("s", DraftBlock(base_length=4, tokens=()), False, events, 1)
    assert events.ready().result(timeout=WAIT_S) is None
    [posted] = events.take()
    assert calls == []
    assert posted.post_id == 1 and isinstance(posted.item, DeadlineExceededError)


def test_closing_a_session_ignores_the_deadline(served: Served) -> None:
    client = served.verifier_client
    run(client.open_session("late", PROMPT, GREEDY, 0))
    late = client.bounded(time.monotonic() - 1.0)
    assert run(late.close_session("late"))  # freed all the same
    _assert_nothing_held(served.verifier)


def test_a_call_outlasting_the_deadline_raises_deadline_exceeded_not_unavailable(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An open, the verifier's call whose answer the router waits for (a block's verdict comes
    # as an event, whatever the deadline: the router checks that itself).
    def slow_open(*args: Any, **kwargs: Any) -> Future[int]:
        slow: Future[int] = Future()
        threading.Timer(0.5, slow.set_result, (len(PROMPT),)).start()
        return slow

    monkeypatch.setattr(served.verifier, "submit_open", slow_open)
    client = served.verifier_client
    with pytest.raises(DeadlineExceededError, match="deadline passed while waiting"):
        run(client.bounded(time.monotonic() + 0.1).open_session("s", PROMPT, GREEDY, 0))
    # The client's own timeout running out with the replica stalled (the open never ends,
    # its engine takes no step): fail over, within a few windows.
    monkeypatch.setattr(served.verifier, "submit_open", lambda *a, **k: Future())
    bounded = client.bounded(time.monotonic() + WAIT_S)
    with pytest.raises(ReplicaUnavailableError, match=r"DEADLINE_EXCEEDED.*no progress"):
        run(bounded.open_session("s", PROMPT, GREEDY, 0, timeout_s=0.1))


def test_a_busy_verifier_is_waited_for_past_the_timeout_not_failed_over(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The open takes 3 s, five of the client's 0.6 s windows, while the engine steps
    # another session's blocks (another router's stream: nothing is heard on this one): each
    # window's probe finds it stepping, so the call is waited for.
    other = GrpcVerifier(served.verifier_client._frames._replica.split(" at ")[1], timeout_s=WAIT_S)
    run(other.open_session("other", PROMPT, GREEDY, 0))
    stop = threading.Event()

    def keep_stepping() -> None:
        committed = len(PROMPT)
        while not stop.is_set():
            events = SessionEvents()
            other.post("other", DraftBlock(base_length=committed, tokens=()), False, events, 1)
            events.ready().result(timeout=WAIT_S)
            [verdict] = events.take()
            committed = verdict.item.committed_length
            if committed > 60:  # the tiny target's context is short: start again
                run(other.close_session("other"))
                run(other.open_session("other", PROMPT, GREEDY, 0))
                committed = len(PROMPT)

    stepper = threading.Thread(target=keep_stepping, daemon=True)
    stepper.start()

    opens = served.verifier.submit_open

    def slow_open(session_id: str, *args: Any, **kwargs: Any) -> Future[int]:
        if session_id != "busy":  # the other session's re-opens are not slowed
            return opens(session_id, *args, **kwargs)
        slow: Future[int] = Future()
        threading.Timer(3.0, slow.set_result, (len(PROMPT),)).start()
        return slow

    try:
        monkeypatch.setattr(served.verifier, "submit_open", slow_open)
        client = GrpcVerifier(
            served.verifier_client._frames._replica.split(" at ")[1], timeout_s=0.6
        )
        try:
            assert run(client.open_session("busy", PROMPT, GREEDY, 0)) == len(PROMPT)
        finally:
            client.close()
    finally:
        stop.set()
        stepper.join(WAIT_S)
        monkeypatch.undo()
        run(other.close_session("other"))
        run(served.verifier_client.close_session("busy"))
        other.close()
    # Stalled (nothing steps) it fails over within a few windows: the test above, with 0.1 s.


def test_a_replica_refusing_an_expired_session_raises_deadline_exceeded(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    def expired(*args: Any, **kwargs: Any) -> None:
        raise DeadlineExceededError("session 's' passed its deadline")

    monkeypatch.setattr(served.drafter, "submit_draft", expired)
    with pytest.raises(DeadlineExceededError, match=r"^session 's' passed its deadline$"):
        # The client has no deadline of its own.
        run(served.drafter_client.draft("s", 4, [], 1))


def test_the_registry_pool_pins_clients_bound_to_the_request_deadline() -> None:
    entries = [
        ReplicaInfo(f"{side}-{i}", side, f"127.0.0.1:{i + 1}", 0, 0).to_dict()
        for side in ("verifier", "drafter")
        for i in range(2)
    ]
    pool = RegistryPool(lambda: entries, refresh_s=0.0)
    past = time.monotonic() - 1.0
    try:
        pinned = pool.pin(speculate=True, deadline=past)
        spare = pool.spare("verifier", frozenset({pinned.verifier_id}), deadline=past)
        assert spare is not None and pinned.drafter is not None
        # Raised by the clients before any call (nothing listens at these addresses).
        for port in (pinned.verifier, pinned.drafter, spare.port):
            with pytest.raises(DeadlineExceededError):
                run(port.open_session("s", PROMPT, GREEDY, 0))
    finally:
        pool.close()


def test_a_request_with_time_to_spare_runs_over_bounded_clients_exactly(
    served: Served, local_tandem: LocalTandem
) -> None:
    pool = RegistryPool(lambda: served.entries, refresh_s=0.0, rpc_timeout_s=WAIT_S)
    local = local_tandem.router
    router = Router.over_pool(pool, local._decode, local._eos_token_ids)
    prompt = encode(local_tandem, CODE_PROMPT)
    try:
        for draft_tokens in (0, 4):
            deadline = time.monotonic() + 10 * WAIT_S
            request = GenerationRequest(prompt, 30, draft_tokens=draft_tokens, deadline=deadline)
            want = local.generate(GenerationRequest(prompt, 30, draft_tokens=draft_tokens))
            assert router.generate(request).tokens == want.tokens
    finally:
        router.close()
        pool.close()
    _assert_nothing_held(served.verifier, served.drafter)


def test_a_running_session_on_a_busy_verifier_is_waited_for_on_a_stalled_one_failed(
    served: Served, local_tandem: LocalTandem, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The router's window of silence is 0.3 s. Busy: each of the verifier's steps takes
    # 0.5 s (a slow device), so the session reports less often than that, but it reports
    # within every two windows: the request ends with the target's tokens. Stalled: the
    # engine is held between steps throughout, and the request fails over (here to no
    # spare: unavailable).
    pool = RegistryPool(lambda: served.entries, refresh_s=0.0, rpc_timeout_s=0.3)
    local = local_tandem.router
    router = Router.over_pool(pool, local._decode, local._eos_token_ids)
    prompt = encode(local_tandem, CODE_PROMPT)
    engine = served.verifier.engine
    run_batch = engine._stepper.run_batch

    def slow_batch(*args: Any) -> None:
        time.sleep(0.5)
        run_batch(*args)

    try:
        want = local.generate(GenerationRequest(prompt, 6, draft_tokens=0))
        monkeypatch.setattr(engine._stepper, "run_batch", slow_batch)
        busy = router.generate(GenerationRequest(prompt, 6, draft_tokens=0))
        assert busy.tokens == want.tokens
        monkeypatch.undo()
        release = threading.Event()
        engine.submit_call(lambda: release.wait(WAIT_S))
        try:
            with pytest.raises(ReplicaUnavailableError, match="no progress"):
                router.generate(GenerationRequest(prompt, 6, draft_tokens=0))
        finally:
            release.set()
        engine.call(lambda: None)  # what the held engine had queued has run
        deadline = time.monotonic() + WAIT_S
        while served.verifier.stats().num_sessions or served.drafter.stats().num_sessions:
            # The failed request's closes, once run.
            assert time.monotonic() < deadline, "the failed request's sessions were not freed"
            time.sleep(0.05)
    finally:
        router.close()
        pool.close()


STREAMS = 8
WINDOW_S = 0.6
"""The router's window of silence in the eight-stream test: long beside the host's own pauses
(on a loaded 2-core CI host the engine thread has gone unscheduled for over half a second
between two steps; two 0.3 s windows then read as a stall)."""
STEP_WINDOWS = 6
"""Its verifier steps, in windows: past the two a check looks back over, by enough that some
checks compare against a probe taken during the same step (at three, every probe that finds the
stream silent compares against one from before the step, and the count alone passes)."""


def test_eight_streams_on_a_verifier_six_windows_a_step_all_end_exactly_none_moved(
    served: Served, local_tandem: LocalTandem, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each verifier step takes six of the router's 0.6 s windows (a device slowed on
    # purpose): no step ends within two windows, so the count alone would call it stalled.
    # The step running then is young, so every check finds it busy: all 8 requests end with
    # the target's tokens and none asks for a spare. Dropping the long-step rule fails this.
    pool = RegistryPool(lambda: served.entries, refresh_s=0.0, rpc_timeout_s=WINDOW_S)
    local = local_tandem.router
    router = Router.over_pool(pool, local._decode, local._eos_token_ids)
    prompt = encode(local_tandem, CODE_PROMPT)
    engine = served.verifier.engine
    run_batch = engine._stepper.run_batch
    spares: list[str] = []
    spare = pool.spare

    def slow_batch(*args: Any) -> None:
        time.sleep(STEP_WINDOWS * WINDOW_S)
        run_batch(*args)

    def counted_spare(side: str, *args: Any, **kwargs: Any) -> Any:
        spares.append(side)
        return spare(side, *args, **kwargs)

    try:
        want = local.generate(GenerationRequest(prompt, 2, draft_tokens=0))
        monkeypatch.setattr(engine._stepper, "run_batch", slow_batch)
        monkeypatch.setattr(pool, "spare", counted_spare)
        results: list[Any] = [None] * STREAMS

        def one(i: int) -> None:
            try:
                results[i] = router.generate(GenerationRequest(prompt, 2, draft_tokens=0))
            except Exception as error:  # asserted below, on the test's thread
                results[i] = error

        callers = [threading.Thread(target=one, args=(i,)) for i in range(STREAMS)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(WAIT_S * 2)
        assert [getattr(r, "tokens", r) for r in results] == [want.tokens] * STREAMS
        assert spares == []
    finally:
        monkeypatch.undo()
        router.close()
        pool.close()
