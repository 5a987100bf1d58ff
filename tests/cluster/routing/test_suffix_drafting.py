"""The suffix drafter as the router uses it: over real gRPC servers (Frames streams), output
equal to the target alone, serial and pipelined, with its blocks really verified; tenants that
never draft from each other's text; a failing suffix drafter dropped without a trace in the
output; and the pure pricing of when a round asks it (`SuffixUse`).

Output is checked on routers whose verifier sessions run (the default) and on lockstep ones
(`verifier_advances` off), where proposed and drafted blocks decide every position: what is
counted (tokens proposed, drafted, accepted) is counted there."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from cluster.local import InProcess, LocalTandem, text_decoder
from cluster.routing.grpc_drafter import GrpcDrafter
from cluster.routing.grpc_verifier import GrpcVerifier
from cluster.routing.request import GenerationRequest, SpeculationStats
from cluster.routing.router import Router
from cluster.routing.suffix_drafting import MAX_SKIPPED_ROUNDS, SuffixDrafting, SuffixUse
from cluster.routing.waits import run
from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.errors import ReplicaUnavailableError
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling_params import SamplingParams
from drafter.config import SuffixConfig
from drafter.drafter import Drafter
from drafter.suffix import SuffixDrafter
from drafter.suffix_servicer import SuffixServicer
from tests.conftest import MAX_TOKENS, PROMPTS, encode
from tests.replicas import serve_drafter, serve_replica, serve_verifier
from verifier.verifier import Verifier

TWO_PROMPTS = (PROMPTS[0], PROMPTS[2])


@dataclass
class Servers:
    suffix: SuffixDrafter
    drafter_address: str
    verifier_address: str
    suffix_address: str


@pytest.fixture(scope="module")
def servers(tiny_target: LoadedModel, tiny_draft: LoadedModel) -> Iterator[Servers]:
    suffix = SuffixDrafter(SuffixConfig())
    started = [
        serve_drafter(Drafter(tiny_draft)),
        serve_verifier(Verifier(tiny_target)),
        serve_replica(SuffixServicer(suffix)),
    ]
    yield Servers(suffix, *(f"127.0.0.1:{port}" for _, port in started))
    for server, _ in started:
        server.stop(None)


@pytest.mark.parametrize("advances", [False, True], ids=["lockstep", "running"])
@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
def test_greedy_with_the_suffix_drafter_over_grpc_equals_the_target_alone(
    servers: Servers,
    tiny_target: LoadedModel,
    local_tandem: LocalTandem,
    target_only: dict[str, tuple[int, ...]],
    advances: bool,
    pipelined: bool,
) -> None:
    drafter = GrpcDrafter(servers.drafter_address, timeout_s=30.0)
    verifier = GrpcVerifier(servers.verifier_address, timeout_s=30.0)
    suffix = GrpcDrafter(servers.suffix_address, timeout_s=30.0)
    router = Router(
        verifier, drafter, text_decoder(tiny_target.tokenizer), tiny_target.eos_token_ids,
        suffix=suffix, pipelined=pipelined, verifier_advances=advances,
    )  # fmt: skip
    tenant = f"tenant-{advances}-{pipelined}"  # each case starts from an empty index
    second = SpeculationStats()
    try:
        for attempt in range(2):  # the second pass finds the first's output in the index
            for prompt in TWO_PROMPTS:
                request = GenerationRequest(
                    encode(local_tandem, prompt), MAX_TOKENS, draft_tokens=4, tenant=tenant
                )
                result = router.generate(request, pipelined=pipelined)
                assert result.tokens == target_only[prompt], (prompt, attempt)
                if attempt == 1:
                    second.suffix_drafted += result.stats.suffix_drafted
                    second.suffix_accepted += result.stats.suffix_accepted
    finally:
        router.close()
    if not advances:
        # Its blocks were verified, and the target agreed with most of what its own text said.
        assert second.suffix_accepted > MAX_TOKENS // 2
    assert second.suffix_accepted <= second.suffix_drafted
    for client in (drafter, verifier, suffix):
        assert client.stats().num_sessions == 0
        client.close()


class SpySuffix(SuffixDrafter):
    """Records every proposal with its tenant and the length it continued."""

    def __init__(self, config: SuffixConfig) -> None:
        super().__init__(config)
        self.proposals: list[tuple[str, int, tuple[int, ...]]] = []
        self.tenants: dict[str, str] = {}

    def open_session(self, session_id: str, *args: object, **kwargs: object) -> int:
        self.tenants[session_id] = str(kwargs.get("tenant", ""))
        return super().open_session(session_id, *args, **kwargs)  # type: ignore[arg-type]

    def draft(
        self, session_id: str, base_length: int, *args: object, **kwargs: object
    ) -> DraftBlock:
        block = super().draft(session_id, base_length, *args, **kwargs)  # type: ignore[arg-type]
        self.proposals.append((self.tenants[session_id], block.base_length, block.tokens))
        return block


def in_process_router(
    local_tandem: LocalTandem, suffix: SuffixDrafter, advances: bool = True
) -> Router:
    """A serial router over the tandem's components and `suffix`; lockstep unless
    `advances`."""
    target = local_tandem.target
    return Router(
        InProcess(local_tandem.verifier), InProcess(local_tandem.drafter),
        text_decoder(target.tokenizer), target.eos_token_ids, suffix=InProcess(suffix),
        pipelined=False, verifier_advances=advances,
    )  # fmt: skip


def first_proposal(spy: SpySuffix, tenant: str, since: int) -> tuple[int, ...]:
    return next(tokens for owner, _, tokens in spy.proposals[since:] if owner == tenant)


@pytest.mark.parametrize("scope", ["tenant", "request"])
def test_no_tenant_drafts_from_another_tenants_text(
    local_tandem: LocalTandem, target_only: dict[str, tuple[int, ...]], scope: str
) -> None:
    """Tenant a's request leaves its output in a's index. The same prompt from tenant b then
    gets nothing proposed at its first ask (its own prompt holds no repeat), while a's next
    request (scope "tenant") is proposed a's earlier output at once. Sharing one index
    across tenants fails the first assertion."""
    spy = SpySuffix(SuffixConfig(scope=scope))
    router = in_process_router(local_tandem, spy)
    prompt = PROMPTS[0]
    tokens = encode(local_tandem, prompt)
    try:
        for tenant in ("a", "b", "a"):
            since = len(spy.proposals)
            request = GenerationRequest(tokens, MAX_TOKENS, draft_tokens=4, tenant=tenant)
            assert router.generate(request).tokens == target_only[prompt]
            if tenant == "b":
                assert first_proposal(spy, "b", since) == ()
    finally:
        router.close()
    again = first_proposal(spy, "a", since)
    if scope == "tenant":
        # Asked as the verifier's session starts: the proposal continues the prompt.
        position = len(tokens)
        assert again and again == target_only[prompt][: len(again)]
        assert spy.proposals[since][1] == position
    else:  # a request's own text only: nothing to continue at the first ask
        assert again == ()
    assert spy.stats().num_sessions == 0


@pytest.mark.parametrize("advances", [False, True], ids=["lockstep", "running"])
def test_a_tenant_that_keeps_its_text_out_is_never_held_nor_drafted_for(
    local_tandem: LocalTandem, target_only: dict[str, tuple[int, ...]], advances: bool
) -> None:
    """`suffix_index: false` (the tenant's config, carried by its requests): the suffix drafter
    is never opened for them, so none of their text enters an index; the model drafts (counted
    on a lockstep router, where its blocks are verified)."""
    spy = SpySuffix(SuffixConfig())
    router = in_process_router(local_tandem, spy, advances)
    prompt = PROMPTS[0]
    try:
        for _ in range(2):
            request = GenerationRequest(
                encode(local_tandem, prompt), MAX_TOKENS, draft_tokens=4, tenant="private",
                suffix_index=False,
            )  # fmt: skip
            result = router.generate(request)
            assert result.tokens == target_only[prompt]
            assert result.stats.suffix_drafted == 0
            if not advances:
                assert result.stats.num_drafted > 0
    finally:
        router.close()
    assert spy.tenants == {} and spy.proposals == []
    assert spy.index_stats().tokens == 0


class FailingSuffix(SuffixDrafter):
    """Opens, then fails every draft as a lost replica does."""

    def __init__(self) -> None:
        super().__init__(SuffixConfig())
        self.drafts = 0

    def draft(self, *args: object, **kwargs: object) -> DraftBlock:
        self.drafts += 1
        raise ReplicaUnavailableError("suffix drafter: connection lost")


@pytest.mark.parametrize("advances", [False, True], ids=["lockstep", "running"])
def test_a_failing_suffix_drafter_is_dropped_and_output_is_unchanged(
    local_tandem: LocalTandem, target_only: dict[str, tuple[int, ...]], advances: bool
) -> None:
    failing = FailingSuffix()
    router = in_process_router(local_tandem, failing, advances)
    try:
        for prompt in TWO_PROMPTS:
            request = GenerationRequest(encode(local_tandem, prompt), MAX_TOKENS, draft_tokens=4)
            result = router.generate(request)
            assert result.tokens == target_only[prompt]
            if not advances:  # counted where its blocks are verified
                assert result.stats.num_drafted > 0  # the model drafted once it was dropped
    finally:
        router.close()
    assert failing.drafts == len(TWO_PROMPTS)  # asked once per request, then dropped
    assert failing.stats().num_sessions == 0  # and its sessions closed


def asks(use: SuffixUse, rounds: int) -> list[bool]:
    return [use.ask() for _ in range(rounds)]


def test_asking_pauses_longer_after_each_fruitless_proposal() -> None:
    use = SuffixUse()
    pauses: list[int] = []
    for _ in range(7):
        assert use.ask()
        use.proposed(0)
        skipped = 0
        while not use.ask():
            skipped += 1
        pauses.append(skipped)
        use.skip = 0  # the ask above was this round's: start the next from here
    assert pauses == [1, 2, 4, 8, 16, MAX_SKIPPED_ROUNDS, MAX_SKIPPED_ROUNDS]


def test_an_accepted_proposal_asks_again_at_once() -> None:
    use = SuffixUse()
    use.proposed(0)
    assert asks(use, 2) == [False, True]
    use.proposed(5)
    use.verified(0)  # proposed but rejected: as fruitless as nothing
    assert use.fruitless == 2
    assert asks(use, 3) == [False, False, True]
    use.proposed(5)
    use.verified(3)
    assert use.fruitless == 0 and asks(use, 3) == [True, True, True]
    assert (use.asked, use.proposed_tokens, use.accepted_tokens) == (3, 10, 3)


def test_a_proposal_shorter_than_the_models_block_is_left_for_the_model() -> None:
    """A real suffix drafter proposes 2 tokens (its match is 2 long): with the model ready to
    draft 4 it is not verified, and counts as fruitless (asking pauses); with 2 it is."""
    suffix = SuffixDrafter(SuffixConfig(min_match=2, tokens_per_match=1.0))
    suffix.open_session("earlier", (5, 6, 7, 8, 9, 10, 11, 12), SamplingParams(), 0, tenant="t")
    request = GenerationRequest((1, 2, 3), 32, tenant="t")
    history = [1, 2, 3, 6, 7]  # "6, 7" recurs: 8, 9 follow, capped at two tokens
    port = InProcess(suffix)
    wanting_four = SuffixDrafting(port, "suffix", "s1")
    assert run(wanting_four.propose(request, history, 16, shortest=4)) is None
    assert wanting_four.use.fruitless == 1 and not wanting_four.use.ask()
    wanting_two = SuffixDrafting(port, "suffix", "s2")
    block = run(wanting_two.propose(request, history, 16, shortest=2))
    assert block is not None and block.tokens == (8, 9)
    assert wanting_two.use.fruitless == 0
    suffix.close()
