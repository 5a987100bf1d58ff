""" "auto" tool choice stays exact: under a tool-call format's grammar, greedy output with
speculation equals the target alone with the same grammar.

The grammar is the one `tool_choice: "auto"` sends (`HermesFormat.grammar`: text without the
opening tag, or text then calls to the tools), and `ForcedHermes` (`tests.cluster.tool_seams`),
the same with the text-only answer left out, so that the random tiny target's constrained
choice goes through a call's name and JSON arguments. The prompt is the tiny chat template's
rendering of a question with the two tools. The reference is `reference_generate`
(`cluster.tools.baselines.hf_reference`): Hugging Face `generate` over the target with
llguidance's own matcher masking each step. Block lengths 1..8, serial and pipelined rounds, on
the default router (verifier sessions run) and a lockstep one (every token through a posted
block), as tests/cluster/routing/test_structured_outputs.py checks the other grammars; and
seed-exact sampling (temperature 1), whose output is the reference's draw whatever was
drafted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest

from cluster.api.tool_format_hermes import HermesFormat
from cluster.local import LocalTandem
from cluster.routing.request import GenerationRequest
from cluster.runtime.constraint import Grammar
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling_params import SamplingParams
from tests.cluster.api.test_openai_auto_tools import ASK, SCHEMAS, TOOLS
from tests.cluster.routing.lockstep_routers import Routers, router_pair
from tests.cluster.routing.test_structured_outputs import (
    MODES,
    Reference,
    Run,
    Tally,
    check_equal_to_reference,
)
from tests.cluster.tool_seams import ForcedHermes

RUNS: list[Run] = [(k, *mode) for k in range(1, 9) for mode in MODES]
"""Every block length 1..8, in each round mode (serial lockstep, pipelined on the default
router, pipelined lockstep)."""
FUNCTIONS = [tool["function"] for tool in TOOLS]
GRAMMARS = {
    "text or calls": (Grammar("lark", HermesFormat().grammar(FUNCTIONS, True)), 48),
    "forced calls": (Grammar("lark", ForcedHermes(min_calls=2).grammar(FUNCTIONS, True)), 220),
}
"""Grammar and max_tokens: room for two whole calls where they are forced."""


@pytest.fixture(scope="module")
def router(local_tandem: LocalTandem) -> Iterator[Routers]:
    """The default router and a lockstep one over the session's tandem (both with the
    target's grammar tokenizer)."""
    built = router_pair(local_tandem.verifier, local_tandem.drafter, local_tandem.target)
    yield built
    built.close()


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_greedy_output_under_the_auto_grammar_equals_the_target_alone(
    name: str, router: Routers, local_tandem: LocalTandem, tiny_target: LoadedModel
) -> None:
    grammar, max_tokens = GRAMMARS[name]
    text = local_tandem.tokenizer.apply_chat_template(
        ASK, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert isinstance(text, str)
    prompt = tuple(text.encode())  # the tiny tokenizer: one token per byte
    expected = Reference(tiny_target)(prompt, grammar, max_tokens=max_tokens)
    tally = Tally()
    request = GenerationRequest(prompt, max_tokens, grammar=grammar)
    assert check_equal_to_reference(router, expected, request, RUNS, tally) == []
    assert tally.drafted > 0 and tally.pipeline_hits > 0  # speculation ran, pipelined too
    if name == "text or calls":
        assert 0 < tally.accepted < tally.drafted, tally  # drafts accepted and rejected
    output = bytes(t for t in expected if t < 256).decode(errors="replace")
    if name == "forced calls":  # the reference itself made two whole, valid calls
        calls = [
            json.loads(part.split("\n</tool_call>")[0])
            for part in output.split("<tool_call>\n")[1:]
        ]
        assert len(calls) >= 2
        for call in calls:
            jsonschema.validate(call["arguments"], SCHEMAS[call["name"]])
    else:
        assert "<tool_call>" not in output


def test_seed_exact_output_under_the_auto_grammar_equals_the_reference(
    router: Routers, local_tandem: LocalTandem, tiny_target: LoadedModel
) -> None:
    sampling = SamplingParams(temperature=1.0, seed_exact=True)
    runs: list[Run] = [(1, False, True), (3, True, False), (8, True, True), (5, False, False)]
    text = local_tandem.tokenizer.apply_chat_template(
        ASK, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert isinstance(text, str)
    prompt, reference, tally = tuple(text.encode()), Reference(tiny_target), Tally()
    mismatches = []
    for name, (grammar, max_tokens) in GRAMMARS.items():
        for seed in (0, 1):
            expected = reference(prompt, grammar, sampling, seed, max_tokens=max_tokens)
            request = GenerationRequest(prompt, max_tokens, sampling, seed=seed, grammar=grammar)
            mismatches += [
                f"{name} seed={seed} {m}"
                for m in check_equal_to_reference(router, expected, request, runs, tally)
            ]
    assert not mismatches, "differs from the reference: " + "; ".join(mismatches)
    assert 0 < tally.accepted < tally.drafted, tally
