"""The router over gRPC replicas: same output as in-process, and errors mapped back to classes.

Two real loopback servers (a drafter and a verifier over the tiny pair) and the router driving
them through `GrpcDrafter` / `GrpcVerifier`; the reference is the in-process router. Output is
compared on the default router (running verifier sessions); what depends on which drafted
tokens decided (speculation statistics, sampled tokens under the rejection rule) is compared
between lockstep routers (`verifier_advances` off), where it does not depend on timing.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest

from cluster.local import LocalTandem, text_decoder
from cluster.routing.grpc_drafter import GrpcDrafter
from cluster.routing.grpc_verifier import GrpcVerifier
from cluster.routing.ports import DrafterPort, VerifierPort
from cluster.routing.request import GenerationRequest
from cluster.routing.router import Router
from cluster.routing.waits import drive, run
from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.errors import (
    InvalidArgumentError,
    ReplicaUnavailableError,
    SessionExistsError,
    SessionNotFoundError,
    StaleBaseError,
)
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling_params import SamplingParams
from drafter.drafter import Drafter
from tests.conftest import MAX_TOKENS as REFERENCE_TOKENS
from tests.conftest import PROMPTS
from tests.replicas import serve_drafter, serve_verifier, verify
from verifier.verifier import Verifier

MAX_TOKENS = 40
GREEDY = SamplingParams()


@dataclass
class Remote:
    """A router over two gRPC replicas, the clients it uses, and the components served."""

    router: Router
    lockstep: Router
    """A router over the same clients whose verifier sessions do not run."""
    drafter: GrpcDrafter
    verifier: GrpcVerifier
    drafter_component: Drafter
    drafter_address: str


@pytest.fixture(scope="module")
def remote(tiny_target: LoadedModel, tiny_draft: LoadedModel) -> Iterator[Remote]:
    drafter_component = Drafter(tiny_draft)
    drafter_server, drafter_port = serve_drafter(drafter_component)
    verifier_server, verifier_port = serve_verifier(Verifier(tiny_target))
    drafter_address = f"127.0.0.1:{drafter_port}"
    drafter = GrpcDrafter(drafter_address, timeout_s=30.0)
    verifier = GrpcVerifier(f"127.0.0.1:{verifier_port}", timeout_s=30.0)
    # The clients must satisfy the router's ports (checked by mypy where this is annotated).
    drafter_port_: DrafterPort = drafter
    verifier_port_: VerifierPort = verifier
    router = Router(
        verifier_port_,
        drafter_port_,
        text_decoder(tiny_target.tokenizer),
        tiny_target.eos_token_ids,
    )
    lockstep = Router(
        verifier,
        drafter,
        text_decoder(tiny_target.tokenizer),
        tiny_target.eos_token_ids,
        verifier_advances=False,
    )
    yield Remote(router, lockstep, drafter, verifier, drafter_component, drafter_address)
    router.close()
    lockstep.close()
    drafter.close()
    verifier.close()
    drafter_server.stop(None)
    verifier_server.stop(None)


def encode(tandem: LocalTandem, text: str) -> tuple[int, ...]:
    return tuple(tandem.tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("draft_tokens", range(9))
def test_greedy_over_grpc_equals_in_process(
    remote: Remote, local_tandem: LocalTandem, lockstep: Router, draft_tokens: int
) -> None:
    for prompt in PROMPTS:
        request = GenerationRequest(
            encode(local_tandem, prompt), MAX_TOKENS, draft_tokens=draft_tokens
        )
        got = remote.router.generate(request)
        want = local_tandem.router.generate(request)
        assert (got.tokens, got.text, got.finish_reason) == (
            want.tokens,
            want.text,
            want.finish_reason,
        ), prompt
        # With running sessions the statistics depend on how fast each side answered (which
        # blocks came before the verifier took their tokens alone), and with pipelining on
        # whether a block drafted ahead came before its predecessor's verdict; in lockstep and
        # unpipelined every round is decided by its drafted block alone, so the statistics
        # must match the in-process router's exactly.
        got_lockstep = remote.lockstep.generate(request, pipelined=False)
        want_lockstep = lockstep.generate(request, pipelined=False)
        assert got_lockstep.tokens == want.tokens, prompt
        assert got_lockstep.stats == want_lockstep.stats, prompt
    assert remote.verifier.stats().num_sessions == 0
    assert remote.drafter.stats().num_sessions == 0


def test_stats_over_grpc_carry_the_engine_figures(remote: Remote) -> None:
    remote.router.generate(GenerationRequest((1, 2, 3), 4, draft_tokens=2))
    over_grpc, direct = remote.drafter.stats().engine, remote.drafter_component.stats().engine
    assert over_grpc is not None and direct is not None
    # Idle now: the counters and the pool read the same on both sides of the wire.
    assert (over_grpc.runner, over_grpc.steps, over_grpc.kv_blocks_total) == (
        direct.runner,
        direct.steps,
        direct.kv_blocks_total,
    )
    assert over_grpc.steps >= 1
    assert remote.verifier.stats().engine is not None


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9),
        SamplingParams(temperature=1.5),
    ],
)
def test_seeded_sampling_over_grpc_equals_in_process(
    remote: Remote, local_tandem: LocalTandem, lockstep: Router, sampling: SamplingParams
) -> None:
    # Sparse q crosses the wire bit for bit, and 0.8 / 0.9 (not float32-exact) arrive rounded
    # to float32, which the float32 sampling code uses anyway: the same seed gives the same
    # tokens. Under the rejection rule the tokens depend on which drafts were verified, so
    # both sides run in lockstep and unpipelined (with running sessions, or a block drafted
    # ahead, that depends on timing).
    for seed, prompt in enumerate(PROMPTS[:4]):
        request = GenerationRequest(
            encode(local_tandem, prompt), MAX_TOKENS, sampling, seed=seed, draft_tokens=4
        )
        got = remote.lockstep.generate(request, pipelined=False)
        assert got.tokens == lockstep.generate(request, pipelined=False).tokens
        assert got.stats.num_drafted > 0  # drafts were verified over the wire


def test_seed_exact_sampling_over_grpc_equals_in_process_with_running_sessions(
    remote: Remote, local_tandem: LocalTandem
) -> None:
    # Seed-exact draws are a function of the seed and the position alone, so whichever blocks
    # the running sessions verified and whichever tokens they took alone, the output is the
    # same on both routers.
    sampling = SamplingParams(temperature=0.8, top_k=40, seed_exact=True)
    for seed, prompt in enumerate(PROMPTS[:4]):
        request = GenerationRequest(
            encode(local_tandem, prompt), MAX_TOKENS, sampling, seed=seed, draft_tokens=4
        )
        assert (
            remote.router.generate(request).tokens == local_tandem.router.generate(request).tokens
        )


# --- errors mapped back to their classes --------------------------------------------------------


@pytest.fixture
def session(remote: Remote, request: pytest.FixtureRequest) -> Iterator[str]:
    session_id = request.node.name
    run(remote.drafter.open_session(session_id, [1, 2, 3], GREEDY, seed=0))
    run(remote.verifier.open_session(session_id, [1, 2, 3], GREEDY, seed=0))
    yield session_id
    run(remote.drafter.close_session(session_id))
    run(remote.verifier.close_session(session_id))


def test_stale_base_raises_stale_base_error(remote: Remote, session: str) -> None:
    with pytest.raises(StaleBaseError, match=r"has committed length 3, but .* based on length 5"):
        run(remote.drafter.draft(session, 5, [], 2))
    # A verifier refuses a block based past its session (its verdict event is the error).
    with pytest.raises(StaleBaseError, match=r"has committed length 3, but .* based on length 5"):
        verify(remote.verifier, session, DraftBlock(base_length=5, tokens=()))


def test_a_block_based_before_the_session_comes_back_dropped(remote: Remote, session: str) -> None:
    # No longer an error: a block based before the session's length is verified from where it
    # stands when it holds what the block assumes, and dropped otherwise (nothing committed).
    verdict = verify(remote.verifier, session, DraftBlock(base_length=2, tokens=()))
    assert verdict.dropped and verdict.tokens == () and verdict.committed_length == 3


def test_unknown_session_raises_session_not_found(remote: Remote) -> None:
    with pytest.raises(SessionNotFoundError, match=r"^no open session 'nobody' \(closed, evicted"):
        verify(remote.verifier, "nobody", DraftBlock(base_length=1, tokens=()))
    assert run(remote.drafter.close_session("nobody")) is False


def test_invalid_arguments_raise_invalid_argument_error(remote: Remote, session: str) -> None:
    with pytest.raises(InvalidArgumentError, match=r"block.tokens\[0\] = 999 is outside"):
        verify(remote.verifier, session, DraftBlock(base_length=3, tokens=(999,)))
    with pytest.raises(InvalidArgumentError, match=re.escape("truncate_to must be in 1..3")):
        run(remote.drafter.draft(session, 3, [], 1, truncate_to=0))
    # Values the wire cannot hold are refused by the client before anything is sent.
    with pytest.raises(InvalidArgumentError, match=re.escape("base_length must be in 0..")):
        run(remote.drafter.draft(session, -1, [], 1))
    with pytest.raises(InvalidArgumentError, match=r"prompt_tokens\[1\] = -4"):
        run(remote.verifier.open_session("other", [1, -4], GREEDY, seed=0))


def test_duplicate_session_raises_session_exists(remote: Remote, session: str) -> None:
    with pytest.raises(SessionExistsError, match="already open"):
        run(remote.verifier.open_session(session, [1], GREEDY, seed=0))


def test_truncate_to_drops_a_rejected_speculative_tail(remote: Remote, session: str) -> None:
    # The drafter assumed block [a, b] accepted (length 5); the verdict kept none and committed
    # one token instead: truncate to 3, append it, and draft on from length 4.
    ahead = run(remote.drafter.draft(session, 3, [7, 8], 1))
    assert ahead.base_length == 5
    block = run(remote.drafter.draft(session, 5, [9], 2, truncate_to=3))
    assert block.base_length == 4


def test_stopped_server_raises_replica_unavailable(tiny_draft: LoadedModel) -> None:
    server, port = serve_drafter(Drafter(tiny_draft))
    with GrpcDrafter(f"127.0.0.1:{port}", timeout_s=5.0) as drafter:
        assert drafter.stats().num_sessions == 0
        server.stop(None).wait()
        with pytest.raises(ReplicaUnavailableError, match=f"drafter at 127.0.0.1:{port}: "):
            drafter.stats()


def test_deadline_raises_replica_unavailable(
    remote: Remote, session: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def slow_stats() -> None:
        time.sleep(0.5)

    monkeypatch.setattr(remote.drafter_component, "stats", slow_stats)
    with pytest.raises(ReplicaUnavailableError, match="DEADLINE_EXCEEDED"):
        remote.drafter.stats(timeout_s=0.05)


def test_internal_error_raises_replica_unavailable_with_the_generic_message(
    remote: Remote, session: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_draft(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("hidden")

    # `submit_draft`: what a draft entry goes through.
    monkeypatch.setattr(remote.drafter_component, "submit_draft", broken_draft)
    with pytest.raises(ReplicaUnavailableError) as caught:
        run(remote.drafter.draft(session, 3, [], 1))
    assert str(caught.value) == (
        f"drafter at {remote.drafter_address}: INTERNAL: internal error; see the replica's log"
    )


def test_client_over_a_given_channel_leaves_it_open(remote: Remote) -> None:
    channel = grpc.insecure_channel(remote.drafter_address)
    drafter = GrpcDrafter(channel)
    drafter.close()
    # Still usable through another client: the channel is the caller's to close.
    assert GrpcDrafter(channel).stats().num_sessions >= 0
    channel.close()


CONCURRENT_STREAMS = 16


def test_greedy_over_frames_at_many_streams_equals_the_target_alone(
    remote: Remote, local_tandem: LocalTandem, target_only: dict[str, tuple[int, ...]]
) -> None:
    # 16 requests at once through one router: their calls share each replica's Frames stream
    # (several sessions' entries per frame), and each output is still the target's alone.
    requests = [
        (prompt, GenerationRequest(encode(local_tandem, prompt), REFERENCE_TOKENS, draft_tokens=k))
        for k in (2, 4)
        for prompt in PROMPTS
    ][:CONCURRENT_STREAMS]
    before = remote.verifier.stats()
    with ThreadPoolExecutor(CONCURRENT_STREAMS) as pool:
        results = list(pool.map(lambda pair: remote.router.generate(pair[1]), requests))
    for (prompt, _), result in zip(requests, results, strict=True):
        assert result.tokens == target_only[prompt], prompt
    after = remote.verifier.stats()
    assert after.entries_received - before.entries_received >= 3 * len(requests)  # over frames
    assert remote.verifier.stats().num_sessions == 0


def test_streams_driven_on_one_event_loop_hold_no_thread_each(
    remote: Remote, local_tandem: LocalTandem, target_only: dict[str, tuple[int, ...]]
) -> None:
    # The routers' own gRPC server runs every stream this way (`cluster.serve.front_grpc`):
    # 32 pipelined requests as waits on one loop; each wait for a frame's answer is awaited
    # there, so no thread is started or held per request, and the output is the target's.
    requests = [
        (prompt, GenerationRequest(encode(local_tandem, prompt), REFERENCE_TOKENS, draft_tokens=k))
        for k in (1, 2, 3, 4, 5, 6)
        for prompt in PROMPTS
    ][:32]
    remote.router.generate(requests[0][1])  # both Frames streams open: their threads exist
    threads_before = threading.active_count()
    most_threads = threads_before

    async def main() -> list[list[int]]:
        nonlocal most_threads

        async def collect(request: GenerationRequest) -> list[int]:
            tokens: list[int] = []
            async for chunk in drive(remote.router.stream_waits(request)):
                nonlocal most_threads
                most_threads = max(most_threads, threading.active_count())
                tokens.extend(chunk.tokens)
            return tokens

        return await asyncio.gather(*(collect(request) for _, request in requests))

    outputs = asyncio.run(main())
    for (prompt, _), tokens in zip(requests, outputs, strict=True):
        assert tuple(tokens) == target_only[prompt], prompt
    assert most_threads <= threads_before + 1, (threads_before, most_threads)
    assert remote.verifier.stats().num_sessions == 0
    assert remote.drafter.stats().num_sessions == 0
