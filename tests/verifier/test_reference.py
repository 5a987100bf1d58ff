"""`verifier.reference.replay`: the plain target's own choice at each served position.

Outputs of the in-process Tandem over the tiny pair (fp32) are replayed: greedy and seed-exact
outputs must match token for token; a corrupted token is found where it was put, with its
gaps; the chunk size changes nothing; the hook runs once per chunk; a rejection-rule request is
refused."""

from __future__ import annotations

import math

import pytest
import torch

from cluster.local import LocalTandem
from cluster.routing.request import GenerationRequest
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.model_spec import TINY_TARGET, ModelSpec
from cluster.runtime.models import LoadedModel, load_model
from cluster.runtime.sampling_params import SamplingParams
from tests.conftest import CODE_PROMPT, PROMPTS, encode
from verifier.reference import Replay, fp32_copy, model_dtype, replay

GREEDY = SamplingParams()
SEED_EXACT = SamplingParams(temperature=0.8, top_p=0.95, seed_exact=True)
MAX_TOKENS = 40


def served(tandem: LocalTandem, text: str, sampling: SamplingParams, seed: int) -> tuple[int, ...]:
    request = GenerationRequest(encode(tandem, text), MAX_TOKENS, sampling, seed=seed)
    return tandem.router.generate(request).tokens


@pytest.mark.parametrize("sampling", [GREEDY, SEED_EXACT], ids=["greedy", "seed-exact"])
@pytest.mark.parametrize("text", PROMPTS[:3])
def test_served_output_replays_exactly(
    local_tandem: LocalTandem, tiny_target: LoadedModel, sampling: SamplingParams, text: str
) -> None:
    tokens = served(local_tandem, text, sampling, seed=11)
    result = replay(tiny_target, encode(local_tandem, text), tokens, sampling, seed=11)
    assert result.tokens == tokens
    assert result.dtype == "float32"
    assert len(result.gaps) == len(tokens) and min(result.gaps) >= 0
    assert result.served_gaps == (0.0,) * len(tokens)


def test_another_seed_is_another_output(
    local_tandem: LocalTandem, tiny_target: LoadedModel
) -> None:
    """The replay really applies the seed: a seed-exact output replayed under another seed
    disagrees somewhere (the tiny target is far from deterministic at temperature 0.8)."""
    tokens = served(local_tandem, CODE_PROMPT, SEED_EXACT, seed=11)
    other = replay(tiny_target, encode(local_tandem, CODE_PROMPT), tokens, SEED_EXACT, seed=12)
    assert other.tokens != tokens


@pytest.mark.parametrize("sampling", [GREEDY, SEED_EXACT], ids=["greedy", "seed-exact"])
def test_a_corrupted_token_is_found_with_its_gaps(
    local_tandem: LocalTandem, tiny_target: LoadedModel, sampling: SamplingParams
) -> None:
    prompt = encode(local_tandem, CODE_PROMPT)
    tokens = served(local_tandem, CODE_PROMPT, sampling, seed=5)
    assert len(tokens) >= 4
    at = len(tokens) // 2
    wrong = (tokens[at] + 1) % tiny_target.vocab_size
    corrupted = (*tokens[:at], wrong, *tokens[at + 1 :])
    result = replay(tiny_target, prompt, corrupted, sampling, seed=5)
    assert result.tokens[:at] == tokens[:at]
    assert result.tokens[at] == tokens[at]  # the target's choice on the same prefix
    assert result.served_gaps[:at] == (0.0,) * at
    assert result.served_gaps[at] >= result.gaps[at] > 0
    if sampling.is_greedy:  # the gaps are raw logits: check them against a plain forward
        with torch.inference_mode():
            row = tiny_target.model(torch.tensor([[*prompt, *tokens[:at]]])).logits[0, -1]
        top = row.topk(2).values
        assert result.gaps[at] == pytest.approx(float(top[0] - top[1]), abs=1e-4)
        assert result.served_gaps[at] == pytest.approx(
            float(row[tokens[at]] - row[wrong]), abs=1e-4
        )


@pytest.mark.parametrize("sampling", [GREEDY, SEED_EXACT], ids=["greedy", "seed-exact"])
def test_chunking_does_not_change_the_result(
    local_tandem: LocalTandem, tiny_target: LoadedModel, sampling: SamplingParams
) -> None:
    prompt = encode(local_tandem, PROMPTS[4])
    tokens = served(local_tandem, PROMPTS[4], sampling, seed=3)
    whole = replay(tiny_target, prompt, tokens, sampling, 3, chunk_tokens=10_000)
    for chunk_tokens in (1, 7, 64):
        chunked = replay(tiny_target, prompt, tokens, sampling, 3, chunk_tokens=chunk_tokens)
        assert chunked.tokens == whole.tokens == tokens
        assert chunked.gaps == pytest.approx(whole.gaps, abs=1e-4)


@pytest.mark.parametrize("chunk_tokens", [1, 5, 16, 1000])
def test_before_chunk_runs_once_per_chunk(
    local_tandem: LocalTandem, tiny_target: LoadedModel, chunk_tokens: int
) -> None:
    prompt = encode(local_tandem, CODE_PROMPT)
    tokens = served(local_tandem, CODE_PROMPT, GREEDY, seed=0)
    calls: list[int] = []
    replay(
        tiny_target, prompt, tokens, GREEDY, 0,
        chunk_tokens=chunk_tokens, before_chunk=lambda: calls.append(1),
    )  # fmt: skip
    # The input is the prompt and every served token but the last (nothing predicts past it).
    assert len(calls) == math.ceil((len(prompt) + len(tokens) - 1) / chunk_tokens)


def test_a_rejection_rule_request_is_refused(tiny_target: LoadedModel) -> None:
    with pytest.raises(InvalidArgumentError, match="statistical mode"):
        replay(tiny_target, [1, 2, 3], [4, 5], SamplingParams(temperature=1.0), seed=0)


@pytest.mark.parametrize(
    ("prompt", "tokens", "chunk_tokens", "message"),
    [
        ([], [1], 64, "prompt"),
        ([1, 2], [999], 64, "vocabulary"),
        ([1, 2], [3], 0, "chunk_tokens"),
    ],
)
def test_bad_input_is_refused(
    tiny_target: LoadedModel, prompt: list[int], tokens: list[int], chunk_tokens: int, message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        replay(tiny_target, prompt, tokens, GREEDY, 0, chunk_tokens=chunk_tokens)


def test_nothing_served_is_an_empty_replay(tiny_target: LoadedModel) -> None:
    calls: list[int] = []
    result = replay(tiny_target, [1, 2], [], GREEDY, 0, before_chunk=lambda: calls.append(1))
    assert result == Replay((), (), "float32", ()) and not calls


def test_fp32_copy_upcasts_a_copy(tiny_target: LoadedModel) -> None:
    assert fp32_copy(tiny_target) is tiny_target
    low = load_model(ModelSpec(TINY_TARGET, dtype="bfloat16", device="cpu"))
    high = fp32_copy(low)
    assert (model_dtype(low), model_dtype(high)) == ("bfloat16", "float32")
    assert high.model is not low.model and high.tokenizer is low.tokenizer
    low_weight = next(low.model.parameters())
    assert torch.equal(next(high.model.parameters()), low_weight.float())  # the same weights
    result = replay(high, [1, 2, 3], [4, 5], GREEDY, 0)
    assert result.dtype == "float32"
