"""Quantized drafts: the int8 layers' arithmetic, which runner serves them, and that a quantized
draft leaves the output exactly the target's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from cluster.local import build_local
from cluster.presets import resolve_pair
from cluster.routing.request import GenerationRequest
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.model_spec import TINY_DRAFT, ModelSpec
from cluster.runtime.models import load_model
from cluster.runtime.quantize import (
    Int8WeightOnlyLinear,
    activations_quantized,
    output_width,
    quantize_rows,
    quantize_weights,
)
from cluster.runtime.runner import PagedModelRunner, SerialModelRunner, build_runner
from tests.conftest import MAX_TOKENS, PROMPTS, encode

CPU = torch.device("cpu")


def test_rows_quantize_within_half_a_step_and_zero_rows_stay_zero() -> None:
    weight = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    weight[3] = 0.0
    scale, q = quantize_rows(weight)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    assert (q.float() * scale[:, None] - weight).abs().max() <= scale.max() / 2 + 1e-7
    assert torch.equal(q[3], torch.zeros_like(q[3]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [True, False])
def test_weight_only_linear_is_the_dequantised_product_and_batch_invariant(
    dtype: torch.dtype, packed: bool
) -> None:
    g = torch.Generator().manual_seed(1)
    linear = nn.Linear(64, 48, bias=True).to(dtype)
    layer = Int8WeightOnlyLinear(linear, packed=packed)
    x = torch.randn(2, 5, 64, generator=g).to(dtype)
    with torch.inference_mode():
        got = layer(x)
        alone = torch.cat([layer(x[:, i : i + 1]) for i in range(5)], dim=1)
    scale, q = quantize_rows(linear.weight.detach())
    bias = linear.bias.detach().float()
    want = nn.functional.linear(x.float(), q.float() * scale[:, None], bias)
    assert got.shape == (2, 5, 48) and got.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    assert (got.float() - want).abs().max() <= tolerance * max(1.0, float(want.abs().max()))
    if packed:
        assert torch.equal(alone, got)  # a row's output never depends on its neighbours
    else:  # a dense matmul: as batch-invariant as any Linear
        assert torch.allclose(alone.float(), got.float(), atol=tolerance)


def test_unknown_quantizations_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="quantization must be one of"):
        ModelSpec(TINY_DRAFT, quantization="int3")
    with pytest.raises(ValueError, match="CPU only"):
        quantize_weights(nn.Sequential(nn.Linear(4, 4)), "int8-dynamic", torch.device("meta"))


@pytest.mark.parametrize(
    ("quantization", "runner", "dtype"),
    [
        ("int8", PagedModelRunner, torch.float32),
        ("int8-dynamic", SerialModelRunner, torch.float32),
    ],
)
def test_a_quantized_draft_loads_with_the_runner_that_keeps_rows_apart(
    quantization: str, runner: type, dtype: torch.dtype
) -> None:
    draft = load_model(ModelSpec(TINY_DRAFT, device="cpu", quantization=quantization))
    assert draft.model.dtype == dtype
    linears = [m for m in draft.model.modules() if type(m) is nn.Linear]
    assert not linears  # every Linear was replaced
    assert activations_quantized(draft.model) is (quantization == "int8-dynamic")
    assert draft.vocab_size == output_width(draft.model) > 0
    built = build_runner(draft, kv_cache_bytes=1 << 20)
    assert isinstance(built, runner)


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int8", "int8-dynamic"])
def test_a_quantized_draft_keeps_greedy_output_exact(
    quantization: str, target_only: dict[str, tuple[int, ...]]
) -> None:
    pair = resolve_pair("tiny", device="cpu")
    pair = dataclasses.replace(
        pair, draft=dataclasses.replace(pair.draft, quantization=quantization)
    )
    tandem = build_local(pair)
    try:
        drafted = 0
        for prompt in PROMPTS:
            for pipelined in (False, True):
                request = GenerationRequest(encode(tandem, prompt), MAX_TOKENS, draft_tokens=4)
                result = tandem.router.generate(request, pipelined=pipelined)
                assert result.tokens == target_only[prompt], (prompt, pipelined)
                drafted += result.stats.num_drafted
        assert drafted > 0  # the quantized draft really drafted
    finally:
        tandem.router.close()
