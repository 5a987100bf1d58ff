"""The drafter's gRPC servicer with chaos on: a share of draft entries answered INTERNAL on purpose
(`DrafterConfig.error_fraction`, for `tandem soak`), drawn from the servicer's own generator."""

from __future__ import annotations

import random

import pytest

from cluster.routing.grpc_drafter import GrpcDrafter
from cluster.routing.waits import run
from cluster.runtime.errors import InvalidArgumentError, ReplicaUnavailableError
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling_params import SamplingParams
from drafter.config import DrafterConfig
from drafter.drafter import Drafter
from drafter.servicer import DrafterServicer
from tests.replicas import serve_replica

PROMPT = (100, 101, 102, 103)
CALLS = 40


def drafts_failed(drafter: Drafter, error_fraction: float, seed: int) -> list[bool]:
    """Per draft entry of `CALLS` on one session, whether it failed on purpose."""
    servicer = DrafterServicer(drafter, error_fraction, random.Random(seed))
    server, port = serve_replica(servicer)
    failed = []
    try:
        with GrpcDrafter(f"127.0.0.1:{port}", timeout_s=30) as client:
            run(client.open_session("s", PROMPT, SamplingParams(), seed=0))
            for _ in range(CALLS):
                try:
                    # Drafts are tentative: the session stays at the prompt's length.
                    run(client.draft("s", len(PROMPT), (), 2))
                    failed.append(False)
                except ReplicaUnavailableError as error:
                    assert "INTERNAL" in str(error) and "on purpose" in str(error)
                    failed.append(True)
            assert run(client.close_session("s"))  # the session calls are never failed
    finally:
        server.stop(None)
    return failed


def test_the_share_of_drafts_failed_follows_the_generator(tiny_draft: LoadedModel) -> None:
    drafter = Drafter(tiny_draft)
    failed = drafts_failed(drafter, 0.3, seed=7)
    draws = random.Random(7)
    assert failed == [draws.random() < 0.3 for _ in range(CALLS)]
    assert 0 < sum(failed) < CALLS  # seed 7 fails some and serves others: both paths ran


def test_none_or_every_draft_fails_at_the_ends(tiny_draft: LoadedModel) -> None:
    drafter = Drafter(tiny_draft)
    assert not any(drafts_failed(drafter, 0.0, seed=1))
    assert all(drafts_failed(drafter, 1.0, seed=1))


@pytest.mark.parametrize("fraction", [-0.1, 1.5, float("nan")])
def test_an_error_fraction_outside_0_1_is_refused(tiny_draft: LoadedModel, fraction: float) -> None:
    with pytest.raises(InvalidArgumentError, match="error_fraction"):
        DrafterConfig(error_fraction=fraction)
    with pytest.raises(InvalidArgumentError, match="error_fraction"):
        DrafterServicer(Drafter(tiny_draft), fraction)


def test_outside_a_serve_replica_there_is_no_rank() -> None:
    # So a drafter hosted anywhere but in Serve (tests, `tandem generate --local`) never errs
    # on purpose: only Serve's rank-0 drafter replica honours `error_fraction`
    # (`drafter.deployment.CHAOS_RANK`).
    from cluster.replica.placement import serve_rank

    assert serve_rank() is None
