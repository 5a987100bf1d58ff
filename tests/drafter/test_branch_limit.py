"""A pre-draft's branch count is the drafter's to check, not only the router's: an entry with
more branches than `MAX_PREDRAFT_FAN_OUT` (the bound the router holds every request to) is
refused with INVALID_ARGUMENT naming the limit, before anything of it runs (its catch-up
tokens are not committed, no fork is made); one with exactly that many is drafted, every
branch. The same over the Frames stream: the refusal is that entry's error, and the stream
serves on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.limits import MAX_PREDRAFT_FAN_OUT
from cluster.runtime.models import LoadedModel
from cluster.runtime.predraft import Branch
from cluster.wire import requests
from drafter.drafter import Drafter
from tests.drafter.test_drafter import GREEDY, PROMPT
from tests.replicas import RawStream, answer, refusal, serve_drafter

BLOCK = (70, 71, 72)
"""The block being verified while the branches are drafted."""
LIMIT_MESSAGE = f"at most {MAX_PREDRAFT_FAN_OUT} branches"


def branches(count: int) -> list[Branch]:
    """`count` distinct branches of BLOCK: every accept length 0..3, then the next rank."""
    return [Branch(index % (len(BLOCK) + 1), index // (len(BLOCK) + 1)) for index in range(count)]


@pytest.fixture
def drafter(tiny_draft: LoadedModel) -> Iterator[Drafter]:
    drafter = Drafter(tiny_draft)
    drafter.open_session("s", PROMPT, GREEDY, seed=0)
    yield drafter
    drafter.close()


def test_more_branches_than_the_limit_are_refused_before_anything_runs(drafter: Drafter) -> None:
    with pytest.raises(InvalidArgumentError, match=LIMIT_MESSAGE) as refused:
        drafter.predraft("s", len(PROMPT), (66,), BLOCK, branches(MAX_PREDRAFT_FAN_OUT + 1), 2)
    assert f"got {MAX_PREDRAFT_FAN_OUT + 1}" in str(refused.value)
    # Nothing of it ran: the catch-up token 66 was not committed (the session is still at
    # the prompt's length, where the next call finds it) and no fork is left in the pool.
    assert drafter.draft("s", len(PROMPT), (66,), 1).base_length == len(PROMPT) + 1
    assert drafter._runner.sequences() == (drafter._sessions.get("s").kv.seq_id,)


def test_exactly_the_limit_drafts_every_branch(drafter: Drafter) -> None:
    asked = branches(MAX_PREDRAFT_FAN_OUT)
    drafts = drafter.predraft("s", len(PROMPT), (66,), BLOCK, asked, 2)
    assert [draft.accepted for draft in drafts] == [branch.accepted for branch in asked]
    assert all(len(draft.tokens) == 2 for draft in drafts)


def test_over_the_frames_stream_the_refusal_is_the_entrys_own(tiny_draft: LoadedModel) -> None:
    drafter = Drafter(tiny_draft)
    server, port = serve_drafter(drafter)
    stream = RawStream(f"127.0.0.1:{port}", service="Drafter")
    try:
        opening = requests.open_request_to_wire("s", PROMPT, GREEDY, 0)
        assert answer(stream.call("open", opening), "opened").committed_length == len(PROMPT)
        over, at = (
            requests.predraft_request_to_wire("s", len(PROMPT), (), BLOCK, branches(count), 2)
            for count in (MAX_PREDRAFT_FAN_OUT + 1, MAX_PREDRAFT_FAN_OUT)
        )
        status, message = refusal(stream.call("predraft", over))
        assert status == "INVALID_ARGUMENT" and LIMIT_MESSAGE in message
        drafted = answer(stream.call("predraft", at), "predrafted")
        assert len(drafted.branches) == MAX_PREDRAFT_FAN_OUT
    finally:
        stream.close()
        server.stop(None)
        drafter.close()
