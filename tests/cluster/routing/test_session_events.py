"""A request's verifier reports (`SessionEvents`): `waiting` tells what `ready` does, without a
future."""

from __future__ import annotations

from cluster.routing.session_events import SessionEvents
from cluster.runtime.errors import ReplicaUnavailableError


def test_waiting_is_true_while_a_report_is_there_to_take() -> None:
    events = SessionEvents()
    assert not events.waiting() and not events.ready().done()
    events.report(ReplicaUnavailableError("gone"))
    assert events.waiting() and events.ready().done()
    assert len(events.take()) == 1
    assert not events.waiting() and not events.ready().done()
