"""The context limit: a request whose prompt plus max_tokens cannot fit the verifier's context
is INVALID_ARGUMENT before anything runs, naming the limit; one that exactly fits completes,
exactly as the target alone would; a drafter with a smaller context stops drafting when full
instead of failing the request. Output is checked on routers whose verifier sessions run (the
default) and on lockstep ones (`verifier_advances` off), where drafted tokens decide every
position, so that the drafting the tests count happens."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import grpc
import pytest

from cluster.api.client import TandemClient
from cluster.api.convert import request_from_proto
from cluster.api.grpc_api import GrpcApi
from cluster.api.request_reader import check_context
from cluster.api.service import TandemService
from cluster.api.status import status_of
from cluster.api.tenants import Tenants
from cluster.local import InProcess, LocalTandem
from cluster.routing.request import FinishReason, GenerationRequest
from cluster.routing.router import Router
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.models import LoadedModel
from drafter.config import DrafterConfig
from drafter.drafter import Drafter
from protos import generate_pb2
from tests.cluster.conftest import TANDEM, TENANT_KEYS, live_replicas, replica_sessions
from tests.cluster.routing.fake_ports import Wrapper
from tests.cluster.routing.lockstep_routers import HeldVerifier
from tests.conftest import CODE_PROMPT, encode
from verifier.config import VerifierConfig
from verifier.verifier import Verifier

LIMIT = 64
"""A small context for the end-to-end fits, so that each runs in a moment."""


def _router(
    tandem: LocalTandem, verifier: Any, drafter: Any, pipelined: bool, advances: bool = True
) -> Router:
    """A router over `verifier` and `drafter` (ports, or plain components); lockstep unless
    `advances`, its verifier then holding a block whose bonus is deferred until the block
    drafted ahead of it is posted (`HeldVerifier`), so that blocks ahead are verified ahead."""
    decode, eos = tandem.router._decode, tandem.router._eos_token_ids
    if isinstance(verifier, Verifier):
        verifier = InProcess(verifier) if advances else HeldVerifier(verifier)
    if isinstance(drafter, Drafter):
        drafter = InProcess(drafter)
    return Router(verifier, drafter, decode, eos, pipelined=pipelined, verifier_advances=advances)


def _service(router: Router, tandem: LocalTandem, max_context_tokens: int) -> TandemService:
    return TandemService(
        router,
        tandem.tokenizer,
        tenants=Tenants.unauthenticated(),
        max_context_tokens=max_context_tokens,
    )


def _message(
    prompt: tuple[int, ...], max_tokens: int, **fields: Any
) -> generate_pb2.GenerateRequest:
    message = generate_pb2.GenerateRequest(max_tokens=max_tokens, **fields)
    message.token_ids.ids.extend(prompt)
    return message


def _target_alone(tandem: LocalTandem, prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    return tandem.router.generate(GenerationRequest(prompt, max_tokens, draft_tokens=0)).tokens


def test_the_message_names_the_limit_and_what_would_fit() -> None:
    check_context(300, 3796, 4096)  # exactly fits
    with pytest.raises(InvalidArgumentError) as error:
        check_context(300, 4000, 4096)
    assert str(error.value) == (
        "prompt of 300 tokens plus max_tokens 4000 exceeds the context limit of 4096 tokens; "
        "lower max_tokens to at most 3796"
    )
    with pytest.raises(InvalidArgumentError, match="the prompt alone fills it") as error:
        check_context(4096, 1, 4096)
    assert "at most 4096" in str(error.value)


def test_a_request_past_the_limit_is_refused_before_any_session_opens(
    local_tandem: LocalTandem,
) -> None:
    # Ports that count the sessions opened on them.
    verifier, drafter = Wrapper(local_tandem.verifier), Wrapper(local_tandem.drafter)
    limit = local_tandem.verifier.config.max_context_tokens
    assert limit == 4096  # the default the acceptance check names
    service = _service(_router(local_tandem, verifier, drafter, True), local_tandem, limit)
    prompt = tuple(range(5, 305))  # 300 tokens
    for call in (
        lambda: GrpcApi(service).generate(_message(prompt, 4000)),
        lambda: next(GrpcApi(service).stream(_message(prompt, 4000))),
        lambda: next(GrpcApi(service).stream(_message(prompt, limit - len(prompt) + 1))),
    ):
        with pytest.raises(InvalidArgumentError) as error:
            call()
        code, message = status_of(error.value)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "context limit of 4096 tokens" in message and "at most 3796" in message
    assert verifier.calls["open"] == drafter.calls["open"] == 0
    usage = GrpcApi(service).usage()
    assert (usage.requests, usage.prompt_tokens, usage.generated_tokens) == (0, 0, 0)


def test_without_a_limit_the_service_does_not_check(local_tandem: LocalTandem) -> None:
    service = TandemService(
        local_tandem.router, local_tandem.tokenizer, tenants=Tenants.unauthenticated()
    )
    request, _ = service.reader.to_request(request_from_proto(_message(tuple(range(5, 305)), 4000)))
    assert request.max_tokens == 4000
    with pytest.raises(InvalidArgumentError, match="max_context_tokens must be >= 1"):
        _service(local_tandem.router, local_tandem, 0)


def test_a_request_filling_the_default_context_exactly_completes_like_the_target_alone(
    local_tandem: LocalTandem,
) -> None:
    limit = local_tandem.verifier.config.max_context_tokens
    prompt = encode(local_tandem, CODE_PROMPT * 400)[: limit - 96]  # the last 96 to generate
    max_tokens = limit - len(prompt)
    service = _service(local_tandem.router, local_tandem, limit)
    message = _message(prompt, max_tokens, speculation={"draft_tokens": 4, "pipelined": True})
    response = GrpcApi(service).generate(message)
    assert len(prompt) + max_tokens == limit
    assert tuple(response.token_ids) == _target_alone(local_tandem, prompt, max_tokens)
    assert len(response.token_ids) == max_tokens or response.finish_reason == (
        generate_pb2.FINISH_REASON_STOP
    )
    assert local_tandem.verifier.stats().num_sessions == 0


@pytest.mark.parametrize("advances", [False, True], ids=["lockstep", "running"])
@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
@pytest.mark.parametrize("draft_tokens", [1, 4, 7])
def test_a_request_that_exactly_fits_never_meets_the_limit(
    local_tandem: LocalTandem,
    tiny_target: LoadedModel,
    tiny_draft: LoadedModel,
    pipelined: bool,
    draft_tokens: int,
    advances: bool,
) -> None:
    verifier = Verifier(tiny_target, VerifierConfig(max_context_tokens=LIMIT))
    drafter = Drafter(tiny_draft, DrafterConfig(max_context_tokens=LIMIT))
    router = _router(local_tandem, verifier, drafter, pipelined, advances)
    prompt = encode(local_tandem, CODE_PROMPT)
    max_tokens = LIMIT - len(prompt)
    try:
        service = _service(router, local_tandem, LIMIT)
        speculation = {"draft_tokens": draft_tokens, "pipelined": pipelined}
        response = GrpcApi(service).generate(_message(prompt, max_tokens, speculation=speculation))
        with pytest.raises(InvalidArgumentError, match=f"at most {max_tokens}"):
            GrpcApi(service).generate(_message(prompt, max_tokens + 1, speculation=speculation))
    finally:
        router.close()
    assert tuple(response.token_ids) == _target_alone(local_tandem, prompt, max_tokens)
    assert len(response.token_ids) == max_tokens  # the tiny target says no EOS this early
    assert response.finish_reason == generate_pb2.FINISH_REASON_LENGTH
    if not advances:  # drafted blocks, and blocks drafted ahead, were verified up to the end
        assert response.speculation.num_drafted > 0
        if pipelined:
            assert response.speculation.pipeline_hits > 0
    assert verifier.stats().num_sessions == drafter.stats().num_sessions == 0


@pytest.mark.parametrize("advances", [False, True], ids=["lockstep", "running"])
@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
@pytest.mark.parametrize(
    "drafter_limit", [40, 8], ids=["fills-mid-generation", "shorter-than-the-prompt"]
)
def test_a_drafter_with_a_smaller_context_stops_drafting_instead_of_failing(
    local_tandem: LocalTandem,
    tiny_target: LoadedModel,
    tiny_draft: LoadedModel,
    pipelined: bool,
    drafter_limit: int,
    advances: bool,
) -> None:
    verifier = Verifier(tiny_target, VerifierConfig(max_context_tokens=LIMIT))
    drafter = Drafter(tiny_draft, DrafterConfig(max_context_tokens=drafter_limit))
    router = _router(local_tandem, verifier, drafter, pipelined, advances)
    prompt = encode(local_tandem, CODE_PROMPT)
    max_tokens = LIMIT - len(prompt)
    assert len(prompt) < drafter_limit < LIMIT or drafter_limit < len(prompt)
    try:
        result = router.generate(GenerationRequest(prompt, max_tokens, draft_tokens=4))
    finally:
        router.close()
    assert result.tokens == _target_alone(local_tandem, prompt, max_tokens)
    assert result.finish_reason == FinishReason.LENGTH
    # It drafted while the drafter had room (counted where every drafted block is verified),
    # and never a token past its context.
    if drafter_limit <= len(prompt):
        assert result.stats.num_drafted == 0
    elif not advances:
        assert result.stats.num_drafted > 0
    assert verifier.stats().num_sessions == drafter.stats().num_sessions == 0


@pytest.mark.ray
@pytest.mark.slow
def test_the_cli_is_refused_at_once_through_the_service(
    service: dict[str, object], local_tandem: LocalTandem
) -> None:
    prompt = ("The quick brown fox jumps over the lazy dog. " * 7)[:300]
    num_prompt_tokens = len(encode(local_tandem, prompt))
    assert 250 <= num_prompt_tokens <= 350  # about 300
    env = service["env"]
    assert isinstance(env, dict)
    with TandemClient(str(service["address"]), timeout_s=60, api_key=TENANT_KEYS["main"]) as c:
        before = c.usage()
        result = subprocess.run(
            [TANDEM, "generate", "--address", str(service["address"]), "--max-tokens", "4000",
             prompt],
            capture_output=True, text=True, timeout=120, check=False, env=env,
        )  # fmt: skip
        after = c.usage()
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.strip() == (
        f"tandem: error: INVALID_ARGUMENT: prompt of {num_prompt_tokens} tokens plus max_tokens "
        f"4000 exceeds the context limit of 4096 tokens; lower max_tokens to at most "
        f"{4096 - num_prompt_tokens}"
    )
    # Nothing ran: the request was never admitted, so no tokens and no sessions.
    for counter in ("requests", "prompt_tokens", "generated_tokens"):
        assert after[counter] == before[counter], json.dumps([before, after])
    assert not any(replica_sessions(service, live_replicas(service)).values())
