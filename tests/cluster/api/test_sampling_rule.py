"""Which rule a request follows (`cluster.api.sampling_rule`), and every way a rule is named.

Resolution: a request's own rule wins; an unnamed one takes the server's default, `auto`
meaning seed-exact exactly when the request carries a seed. The tests walk the whole table
through `resolve_seed_exact` and through `RequestReader.to_request` under each server default,
then every door a rule comes in by: the replica wire (`sampling_to_wire` / `sampling_from_wire`,
round trip, out-of-range values), the OpenAI body's `sampling_rule` field (accepted values, a
400 naming the field), the gRPC client's `build_request`, the config file, and the verifier's
fault switch. An end-to-end check closes it: a seeded OpenAI request under `auto` is
`reference_generate`'s output, and under `rejection` it is not (for some of a few seeds).
No statistics here: every check is exact.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from cluster.api.client_types import TandemClientError, build_request
from cluster.api.convert import request_from_proto
from cluster.api.openai import OpenAIService, Route, error_response
from cluster.api.openai_errors import OpenAIError
from cluster.api.sampling_rule import (
    AUTO,
    REJECTION,
    SAMPLING_RULES,
    SEED_EXACT,
    check_rule_name,
    resolve_seed_exact,
    rule_name,
    rule_to_proto,
)
from cluster.api.service import TandemService
from cluster.api.service_config import ServiceConfig
from cluster.api.tenants import Tenants
from cluster.config import TandemConfig
from cluster.local import LocalTandem
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.sampling_params import SamplingParams
from cluster.tools.baselines.hf_reference import reference_generate
from cluster.wire.sampling_settings import sampling_from_wire, sampling_to_wire
from protos import generate_pb2, sampling_pb2
from tests.conftest import CODE_PROMPT

UNSPECIFIED = sampling_pb2.SAMPLING_RULE_UNSPECIFIED
SEED_EXACT_RULE = sampling_pb2.SAMPLING_RULE_SEED_EXACT
REJECTION_RULE = sampling_pb2.SAMPLING_RULE_REJECTION
OUT_OF_RANGE = 9
"""An int no SamplingRule has (proto3 enums are open: the wire carries it)."""

RESOLUTION = [
    # (the request's rule, whether it is seeded, the server's default) -> seed-exact?
    (SEED_EXACT_RULE, False, AUTO, True),
    (SEED_EXACT_RULE, True, AUTO, True),
    (SEED_EXACT_RULE, False, REJECTION, True),
    (SEED_EXACT_RULE, True, REJECTION, True),
    (REJECTION_RULE, True, AUTO, False),
    (REJECTION_RULE, False, AUTO, False),
    (REJECTION_RULE, True, SEED_EXACT, False),
    (REJECTION_RULE, False, SEED_EXACT, False),
    (UNSPECIFIED, True, AUTO, True),
    (UNSPECIFIED, False, AUTO, False),
    (UNSPECIFIED, True, SEED_EXACT, True),
    (UNSPECIFIED, False, SEED_EXACT, True),
    (UNSPECIFIED, True, REJECTION, False),
    (UNSPECIFIED, False, REJECTION, False),
]
"""The whole table: an explicit rule wins; auto follows the seed; otherwise the default."""
RESOLUTION_IDS = [
    f"{sampling_pb2.SamplingRule.Name(rule).removeprefix('SAMPLING_RULE_').lower()}-"
    f"{'seeded' if seeded else 'unseeded'}-default-{default}"
    for rule, seeded, default, _ in RESOLUTION
]


# --- resolution ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("rule", "seeded", "default", "expected"), RESOLUTION, ids=RESOLUTION_IDS)
def test_resolve_seed_exact_follows_the_table(
    rule: int, seeded: bool, default: str, expected: bool
) -> None:
    assert resolve_seed_exact(rule, seeded, default) is expected


def test_the_default_default_is_auto() -> None:
    assert resolve_seed_exact(UNSPECIFIED, True) is True
    assert resolve_seed_exact(UNSPECIFIED, False) is False
    assert ServiceConfig().sampling_rule == AUTO


def test_a_rule_that_is_no_sampling_rule_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=rf"sampling\.rule {OUT_OF_RANGE} is not"):
        resolve_seed_exact(OUT_OF_RANGE, True)
    with pytest.raises(InvalidArgumentError, match="sampling_rule must be one of"):
        resolve_seed_exact(UNSPECIFIED, True, "bogus")


def test_rule_names_and_their_wire_values() -> None:
    assert SAMPLING_RULES == (AUTO, SEED_EXACT, REJECTION) == ("auto", "seed_exact", "rejection")
    assert [rule_to_proto(name) for name in SAMPLING_RULES] == [
        UNSPECIFIED,
        SEED_EXACT_RULE,
        REJECTION_RULE,
    ]
    assert (rule_name(True), rule_name(False)) == (SEED_EXACT, REJECTION)
    for name in SAMPLING_RULES:
        assert check_rule_name(name, "field") == name
    for bad in ("bogus", "SEED_EXACT", "seed-exact", "", None, 1, True):
        with pytest.raises(InvalidArgumentError, match=r"^where must be one of auto, seed_exact"):
            check_rule_name(bad, "where")
    with pytest.raises(InvalidArgumentError):
        rule_to_proto("bogus")


def test_sampling_params_take_a_boolean_rule_that_greedy_ignores() -> None:
    assert SamplingParams(temperature=0.5, seed_exact=True).draws_seed_exact
    assert not SamplingParams(temperature=0.5).draws_seed_exact
    assert not SamplingParams(seed_exact=True).draws_seed_exact  # greedy: no noise to key
    with pytest.raises(InvalidArgumentError, match="seed_exact must be a bool"):
        SamplingParams(temperature=0.5, seed_exact=1)  # type: ignore[arg-type]


# --- the server's default and the service -------------------------------------------------------


def test_service_config_refuses_an_unknown_rule() -> None:
    for name in SAMPLING_RULES:
        assert ServiceConfig(sampling_rule=name).sampling_rule == name
    with pytest.raises(InvalidArgumentError, match="sampling_rule must be one of"):
        ServiceConfig(sampling_rule="bogus")
    assert TandemConfig.from_dict({"api": {"sampling_rule": "rejection"}}).api.sampling_rule == (
        REJECTION
    )
    with pytest.raises(InvalidArgumentError, match="sampling_rule"):
        TandemConfig.from_dict({"api": {"sampling_rule": "bogus"}})


@pytest.fixture(scope="module")
def services(local_tandem: LocalTandem) -> dict[str, TandemService]:
    """A service over the session's router for each server default."""
    return {
        default: TandemService(
            local_tandem.router,
            local_tandem.tokenizer,
            ServiceConfig(default_pipelined=False, sampling_rule=default),
            tenants=Tenants.unauthenticated(),
        )
        for default in SAMPLING_RULES
    }


def message(rule: int, seeded: bool, temperature: float = 0.8) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(
        text=CODE_PROMPT,
        max_tokens=12,
        sampling=sampling_pb2.SamplingParams(temperature=temperature, rule=rule),  # type: ignore[arg-type]
    )
    if seeded:
        request.seed = 42
    return request


@pytest.mark.parametrize(("rule", "seeded", "default", "expected"), RESOLUTION, ids=RESOLUTION_IDS)
def test_to_request_sets_the_resolved_rule(
    services: dict[str, TandemService], rule: int, seeded: bool, default: str, expected: bool
) -> None:
    converted, _ = services[default].reader.to_request(request_from_proto(message(rule, seeded)))
    assert converted.sampling.seed_exact is expected
    assert converted.sampling.draws_seed_exact is expected
    if seeded:
        assert converted.seed == 42
    # A greedy request resolves the same way, and draws nothing either way.
    greedy, _ = services[default].reader.to_request(
        request_from_proto(message(rule, seeded, temperature=0.0))
    )
    assert greedy.sampling.seed_exact is expected and not greedy.sampling.draws_seed_exact


def test_to_request_refuses_a_rule_that_is_no_sampling_rule(
    services: dict[str, TandemService],
) -> None:
    for seeded in (False, True):
        with pytest.raises(InvalidArgumentError, match="is not a SamplingRule") as raised:
            services[AUTO].reader.to_request(request_from_proto(message(OUT_OF_RANGE, seeded)))
        assert raised.value.status == "INVALID_ARGUMENT"


# --- the replica wire ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed_exact", [False, True])
def test_the_wire_carries_the_resolved_rule(seed_exact: bool) -> None:
    # top_p 0.5 is exact in float32, so the round trip can be compared exactly.
    params = SamplingParams(temperature=0.5, top_k=7, top_p=0.5, seed_exact=seed_exact)
    wire = sampling_to_wire(params)
    assert wire.rule == (SEED_EXACT_RULE if seed_exact else REJECTION_RULE)  # never unspecified
    assert sampling_from_wire(wire) == params
    decoded = sampling_pb2.SamplingParams.FromString(wire.SerializeToString())
    assert sampling_from_wire(decoded) == params


def test_the_wire_reads_an_unspecified_rule_as_rejection_and_refuses_others() -> None:
    unspecified = sampling_pb2.SamplingParams(temperature=0.5)
    assert sampling_from_wire(unspecified) == SamplingParams(temperature=0.5, seed_exact=False)
    bad = sampling_pb2.SamplingParams(temperature=0.5, rule=OUT_OF_RANGE)  # type: ignore[arg-type]
    bad = sampling_pb2.SamplingParams.FromString(bad.SerializeToString())  # as a replica gets it
    assert bad.rule == OUT_OF_RANGE
    with pytest.raises(InvalidArgumentError, match=rf"sampling\.rule {OUT_OF_RANGE}") as raised:
        sampling_from_wire(bad)
    assert raised.value.status == "INVALID_ARGUMENT"


# --- the OpenAI body ----------------------------------------------------------------------------

ROUTES: tuple[Route, Route] = ("completions", "chat.completions")
DROP = object()
"""A field value meaning "leave the field out"."""


@pytest.fixture(scope="module")
def openai(services: dict[str, TandemService]) -> OpenAIService:
    return OpenAIService(services[AUTO], "tiny")


def body(route: Route, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": "tiny", "max_tokens": 12, "temperature": 0.8}
    if route == "completions":
        base["prompt"] = CODE_PROMPT
    else:
        base["messages"] = [{"role": "user", "content": CODE_PROMPT}]
    base |= fields
    return {key: value for key, value in base.items() if value is not DROP}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("auto", UNSPECIFIED),
        ("seed_exact", SEED_EXACT_RULE),
        ("rejection", REJECTION_RULE),
        (None, UNSPECIFIED),  # null: OpenAI's "not given"
        (DROP, UNSPECIFIED),
    ],
    ids=["auto", "seed_exact", "rejection", "null", "absent"],
)
def test_openai_sampling_rule_values_reach_the_request(
    openai: OpenAIService, route: Route, value: object, expected: int
) -> None:
    _, request = openai.to_api_request(route, body(route, sampling_rule=value))
    assert rule_to_proto(request.rule) == expected


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("value", ["bogus", "SEED_EXACT", "", 1, True, ["seed_exact"]])
def test_a_bad_openai_sampling_rule_is_a_400_naming_the_field(
    openai: OpenAIService, local_tandem: LocalTandem, route: Route, value: object
) -> None:
    with pytest.raises(OpenAIError) as raised:
        openai.complete(route, body(route, sampling_rule=value))
    assert raised.value.param == "sampling_rule"
    assert "sampling_rule must be one of auto, seed_exact, rejection" in str(raised.value)
    status, error, _ = error_response(raised.value)
    assert (status, error["error"]["param"], error["error"]["type"]) == (
        400,
        "sampling_rule",
        "invalid_request_error",
    )
    with pytest.raises(OpenAIError) as from_stream:
        next(iter(openai.stream(route, body(route, sampling_rule=value, stream=True))))
    assert from_stream.value.param == "sampling_rule"
    assert local_tandem.verifier.stats().num_sessions == 0


def test_a_seeded_openai_request_is_the_reference_under_auto_and_not_under_rejection(
    openai: OpenAIService, services: dict[str, TandemService], local_tandem: LocalTandem
) -> None:
    service = services[AUTO]
    rejection_differs = 0
    for seed in range(4):
        fields = {"seed": seed, "top_p": 0.9, "max_tokens": 24, "draft_tokens": 4}
        _, auto = openai.to_api_request("completions", body("completions", **fields))
        converted, _ = service.reader.to_request(auto)  # the settings as the router gets them
        assert converted.sampling.seed_exact
        expected = reference_generate(
            local_tandem.target,
            converted.prompt_tokens,
            24,
            converted.sampling,
            seed,
            sorted(local_tandem.target.eos_token_ids),
        )
        assert service.generate(service.authenticate(), auto).tokens == expected
        text = openai.complete("completions", body("completions", **fields))
        assert text["choices"][0]["text"] == local_tandem.tokenizer.decode(
            list(expected), skip_special_tokens=True
        )
        _, rejection = openai.to_api_request(
            "completions", body("completions", sampling_rule="rejection", **fields)
        )
        rejection_differs += service.generate(service.authenticate(), rejection).tokens != expected
    assert rejection_differs > 0


# --- the gRPC client and the verifier's faults ----------------------------------------------------


def test_build_request_names_the_rule_or_refuses_it() -> None:
    for name, expected in zip(
        SAMPLING_RULES, (UNSPECIFIED, SEED_EXACT_RULE, REJECTION_RULE), strict=True
    ):
        request = build_request(CODE_PROMPT, max_tokens=4, temperature=0.5, sampling_rule=name)
        assert request.sampling.rule == expected
    assert build_request(CODE_PROMPT, max_tokens=4).sampling.rule == UNSPECIFIED
    with pytest.raises(TandemClientError) as raised:
        build_request(CODE_PROMPT, max_tokens=4, sampling_rule="x")
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling_rule must be one of auto, seed_exact, rejection, got 'x'" in str(raised.value)
