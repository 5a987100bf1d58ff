"""int4 drafts: the grouped quantization's arithmetic, the layer against its dequantised
reference (packed and not, with shapes the kernel must be padded for), which runner serves an
int4 draft, and that drafting with the target's own int4 weights leaves the output exactly the
target's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from cluster.local import build_local
from cluster.presets import resolve_pair
from cluster.routing.request import GenerationRequest
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.model_spec import TINY_DRAFT, TINY_TARGET, ModelSpec
from cluster.runtime.models import load_model
from cluster.runtime.quantize import (
    INT4_GROUP_SIZE,
    INT4_GROUP_SIZES,
    Int4WeightOnlyLinear,
    dequantize_groups,
    int4_packed_mm_works,
    output_width,
    quantize_groups,
    quantize_weights,
)
from cluster.runtime.runner import PagedModelRunner, build_runner
from tests.conftest import MAX_TOKENS, PROMPTS, encode

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(
    not int4_packed_mm_works(CPU), reason="this torch has no CPU int4 kernel"
)


def test_groups_quantize_within_half_a_step() -> None:
    weight = torch.randn(6, 128, generator=torch.Generator().manual_seed(0))
    weight[2, :64] = 0.25  # a constant group
    codes, scale, zero = quantize_groups(weight, 64)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert scale.shape == zero.shape == (6, 2)
    back = dequantize_groups(codes, scale, zero, torch.float32)
    step = scale.repeat_interleave(64, dim=1)
    assert ((back - weight).abs() <= step / 2 + 1e-6).all()
    assert torch.allclose(back[2, :64], torch.full((64,), 0.25))
    # Each group's own range: a group of large weights leaves its neighbour's step small.
    weight[0, 64:] *= 100
    _, scale, _ = quantize_groups(weight, 64)
    assert float(scale[0, 1]) > 50 * float(scale[0, 0])


@pytest.mark.parametrize(
    ("in_features", "out_features", "group_size"),
    # Whole groups and whole row tiles of 16; rows to pad; input channels to pad.
    [(128, 32, 64), (64, 40, 32), (96, 48, 64)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [pytest.param(True, marks=needs_kernel), False])
def test_int4_linear_is_the_dequantised_product_and_keeps_rows_apart(
    in_features: int, out_features: int, group_size: int, dtype: torch.dtype, packed: bool
) -> None:
    g = torch.Generator().manual_seed(1)
    linear = nn.Linear(in_features, out_features, bias=True).to(dtype)
    layer = Int4WeightOnlyLinear(linear, packed=packed, group_size=group_size)
    x = torch.randn(2, 5, in_features, generator=g).to(dtype)
    with torch.inference_mode():
        got = layer(x)
        alone = torch.cat([layer(x[:, i : i + 1]) for i in range(5)], dim=1)
    # The reference quantizes the zero-padded weight as the layer does, in float32.
    padded_in = -(-in_features // group_size) * group_size
    padded = torch.zeros(out_features, padded_in)
    padded[:, :in_features] = linear.weight.detach().float()
    codes, scale, zero = quantize_groups(padded, group_size)
    weight = dequantize_groups(codes, scale.to(dtype), zero.to(dtype), torch.float32)
    want = nn.functional.linear(x.float(), weight[:, :in_features], linear.bias.detach().float())
    assert got.shape == (2, 5, out_features) and got.dtype == dtype
    # bf16 rounds the activations' products (8 bits of mantissa): 5e-2 of the largest logit
    # is the runner self-test's bound for 16-bit dtypes; a wrong layout or padding errs by O(1).
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    scale_of = max(1.0, float(want.abs().max()))
    assert (got.float() - want).abs().max() <= tolerance * scale_of
    # A row's output depends on its own input only (a batched step gives each session what
    # it gets alone), up to the rounding of a different matmul shape.
    assert (alone.float() - got.float()).abs().max() <= tolerance * scale_of


def test_group_sizes_the_kernel_does_not_take_are_refused() -> None:
    linear = nn.Linear(64, 16)
    assert INT4_GROUP_SIZE in INT4_GROUP_SIZES
    with pytest.raises(ValueError, match="group size must be one of 32, 64, 128, 256"):
        Int4WeightOnlyLinear(linear, packed=False, group_size=16)
    with pytest.raises(ValueError, match="group size must be one of"):
        quantize_weights(nn.Sequential(linear), "int4", CPU, group_size=48)
    with pytest.raises(ValueError, match="not whole groups"):
        quantize_groups(torch.ones(4, 96), 64)


def test_int4_is_a_quantization_a_spec_accepts() -> None:
    assert ModelSpec(TINY_DRAFT, quantization="int4").quantization == "int4"
    with pytest.raises(InvalidArgumentError, match="quantization must be one of"):
        ModelSpec(TINY_DRAFT, quantization="int3")


@pytest.mark.parametrize("source", [TINY_DRAFT, TINY_TARGET])
def test_an_int4_draft_replaces_every_linear_and_is_batched_by_the_paged_runner(
    source: str,
) -> None:
    draft = load_model(ModelSpec(source, device="cpu", quantization="int4"))
    assert not [m for m in draft.model.modules() if type(m) is nn.Linear]
    layers = [m for m in draft.model.modules() if isinstance(m, Int4WeightOnlyLinear)]
    assert layers and all(m.packed is int4_packed_mm_works(CPU) for m in layers)
    # The tiny head has 257 rows: padded to 272 for the kernel, cut back in the logits.
    assert draft.vocab_size == output_width(draft.model) == 257
    assert isinstance(build_runner(draft, kv_cache_bytes=1 << 20), PagedModelRunner)


@pytest.mark.slow
def test_the_targets_own_int4_weights_draft_and_greedy_output_stays_exact(
    target_only: dict[str, tuple[int, ...]],
) -> None:
    pair = resolve_pair("tiny", device="cpu")
    pair = dataclasses.replace(pair, draft=dataclasses.replace(pair.target, quantization="int4"))
    # In lockstep rounds every block is verified, so the counts measure agreement: a running
    # session takes the target's tokens by itself wherever a block comes late.
    tandem = build_local(pair, verifier_advances=False)
    try:
        drafted = accepted = 0
        for prompt in PROMPTS:
            for pipelined in (False, True):
                request = GenerationRequest(encode(tandem, prompt), MAX_TOKENS, draft_tokens=4)
                result = tandem.router.generate(request, pipelined=pipelined)
                assert result.tokens == target_only[prompt], (prompt, pipelined)
                # Verified blocks only (a draft ahead of a block not accepted whole is dropped
                # unverified, and counted in num_drafted with none accepted).
                drafted += sum(result.stats.drafted_by_position)
                accepted += sum(result.stats.accepted_by_position)
        # The int4 copy really drafted, and it agrees with its own full-precision target often
        # (a random tiny target: 4 bits per weight still keep most greedy choices).
        assert drafted > 0 and accepted > drafted / 2
    finally:
        tandem.router.close()
