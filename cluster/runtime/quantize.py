"""A cheaper draft: int8 or int4 weights for a model's Linear layers.

The lossless rule makes the draft free to be anything (the verifier accepts against the q the
drafter actually sampled from), so a quantized draft changes the speed, never the output. The
target is never quantized: its distribution is what the service must reproduce.

- `int8`: weight-only, symmetric, one scale per output channel (row of the weight), on every
  device (`Int8WeightOnlyLinear`): the activations stay in the model's dtype and torch's
  `_weight_int8pack_mm` applies the scales (where a device lacks it, the weight is dequantised
  into the activations' dtype per call: correct everywhere, slower). Each output row depends on
  its own input row only, so a batched step gives every session what it gets alone, and the
  engine's paged runner serves it.
- `int8-dynamic` (CPU only): torch's built-in dynamic quantization
  (`torch.ao.quantization.quantize_dynamic`, per-channel weights) with fbgemm/oneDNN int8
  kernels (VNNI); the activations are quantized too, with one scale per call. Its kernels take
  float32 activations, so the rest of the model runs in float32 (`compute_dtype`). The shared
  scale makes a row depend on the other rows of its batch (on Qwen, whose first positions carry
  huge activations, by half the logits' range), so the paged runner's self-test refuses it
  and the drafter decodes one session at a time: the fastest draft for one stream, not for many.
- `int4`: weight-only, asymmetric, one scale and zero per group of `INT4_GROUP_SIZE` input
  channels of each output channel (`Int4WeightOnlyLinear`), multiplied by torch's CPU kernel
  `_weight_int4pack_mm_for_cpu`, which takes groups of 32 to 256 and output rows in multiples
  of 16 (the padding is zeros, its outputs cut off: Qwen's 151,936-row head needs none, a
  trimmed head does). Elsewhere the codes are dequantised per call. Rows stay independent, so
  the paged runner serves it (its self-test passes on the 1.5B). Meant for a self-draft: the
  target's own weights in 5 bits a weight, 4 for the code and, in groups of 32, 1 for the bf16
  scale and zero: under a third of bf16's bytes (`cluster.presets`, `qwen-coder-self-int4`).

Every Linear is quantized, the output head included (with tied embeddings the head becomes its
own int4 copy and the input embeddings stay as they were: a lookup reads one row a token).
Embeddings, norms and attention have no Linear weights and stay in the model's dtype.

Measured on the 2-core AVX-512 CPU (VNNI, no AMX), one intra-op thread, the 0.5B
Qwen2.5-Coder draft decoding one token with a KV cache (median of 24 steps; greedy output equal
to bf16's on all 24): bf16 138 ms/token, fp32 145; `int8` in bf16 86; `int8-dynamic` 51 (per
tensor weights 52); a per-row dynamic variant over `torch._int_mm` 100; torchao 0.18's
`Int8WeightOnlyConfig` in bf16 319 and `Int8DynamicActivationInt8WeightConfig` in fp32 539.
torchao is the slowest here, so the project uses torch's own kernels and does not depend on it.

The target's own weights as the draft (Qwen2.5-Coder-1.5B; `python -m
cluster.tools.bench.draft_forms --preset qwen-coder --self --self-precisions int8 int4
--group-sizes 32 64 128 --max-tokens 48`: one thread, greedy agreement with the bf16 target's
48-token continuations of the nine default bench prompts, teacher-forced; a shared machine):
the bf16 target 235.5 ms/token; `int8` 110.9 ms/token, agreement 97.9%; `int4` in groups of
32: 56.2 ms, 95.1%; 64: 54.4 ms, 94.2%; 128: 55.7 ms, 91.4%. The time hardly moves with the
group size and agreement falls as groups grow. 32 also matches the pack's source, a Q4_K_M
GGUF whose 4-bit blocks are 32 weights wide, so `INT4_GROUP_SIZE` is 32. The 0.5B draft
(`int8`, 65,536 ids) in the same run: 31.6 ms, 77.1%.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

from cluster.runtime.model_spec import check_quantization

INT4_GROUP_SIZES = (32, 64, 128, 256)
"""Group sizes torch's CPU int4 kernel takes."""
INT4_GROUP_SIZE = 32
"""Input channels per int4 scale and zero: chosen by measurement (module docstring)."""
_INT4_ROWS_MULTIPLE = 16
"""The packed int4 weight's output rows must be a multiple of this (the kernel's tiles)."""


def compute_dtype(quantization: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the model's unquantized parts run in: float32 under `int8-dynamic` (its kernels
    take float32 activations), else `dtype`."""
    return torch.float32 if quantization == "int8-dynamic" else dtype


def quantize_weights(
    model: nn.Module,
    quantization: str,
    device: torch.device,
    group_size: int = INT4_GROUP_SIZE,
) -> nn.Module:
    """Quantize `model`'s Linear layers in place (on `device`, already cast); returns it.
    `group_size`: input channels per scale under `int4` (one of `INT4_GROUP_SIZES`)."""
    check_quantization(quantization)
    check_group_size(group_size)
    if quantization == "none":
        return model
    if quantization == "int8-dynamic":
        if device.type != "cpu":
            raise ValueError(f"int8-dynamic runs on a CPU only (the model is on {device})")
        qconfig = {nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}
        with warnings.catch_warnings():
            # torch 2.13 announces that quantized tensor types will go; the pinned one has them.
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions")
            torch.ao.quantization.quantize_dynamic(model, qconfig, dtype=torch.qint8, inplace=True)
        return model
    if quantization == "int4":
        packed = int4_packed_mm_works(device)
        _swap_linears(model, lambda linear: Int4WeightOnlyLinear(linear, packed, group_size))
    else:
        packed = packed_mm_works(device)
        _swap_linears(model, lambda linear: Int8WeightOnlyLinear(linear, packed))
    return model


class Int8WeightOnlyLinear(nn.Module):
    """A Linear with int8 weights and one float scale per output channel (weight-only)."""

    def __init__(self, linear: nn.Linear, packed: bool) -> None:
        super().__init__()
        weight = linear.weight.detach()
        scale, quantized = quantize_rows(weight)
        self.weight_int8: Tensor
        self.scale: Tensor
        self.register_buffer("weight_int8", quantized)  # [out, in]
        self.register_buffer("scale", scale.to(weight.dtype))  # [out]
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = packed
        """Multiply with `_weight_int8pack_mm` (else dequantise per call)."""

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.packed:
            out = torch._weight_int8pack_mm(flat, self.weight_int8, self.scale.to(x.dtype))
        else:
            weight = self.weight_int8.to(x.dtype) * self.scale.to(x.dtype)[:, None]
            out = flat @ weight.T
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


def quantize_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per row: (scale [out] float32, int8 [out, in]) with weight ~ q * scale."""
    w = weight.to(torch.float32)
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
    quantized = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return scale, quantized


def packed_mm_works(device: torch.device) -> bool:
    """Whether torch's `_weight_int8pack_mm` runs on `device` (a small probe)."""
    try:
        x = torch.ones(1, 32, dtype=torch.bfloat16, device=device)
        w = torch.ones(32, 32, dtype=torch.int8, device=device)
        torch._weight_int8pack_mm(x, w, torch.ones(32, dtype=torch.bfloat16, device=device))
    except (RuntimeError, NotImplementedError):
        return False
    return True


class Int4WeightOnlyLinear(nn.Module):
    """A Linear with 4-bit weights and, per `group_size` input channels of each output channel,
    one float scale and zero (weight-only, asymmetric: w ~ (q - 8) * scale + zero, q in 0..15).

    Packed (`packed`): torch's CPU kernel, which wants whole groups and output rows in multiples
    of 16; zero weights pad both, so the padding adds nothing to a product, and its extra outputs
    are cut off. Else two codes a byte, dequantised into the activations' dtype per call.
    """

    def __init__(self, linear: nn.Linear, packed: bool, group_size: int = INT4_GROUP_SIZE) -> None:
        super().__init__()
        check_group_size(group_size)
        weight = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size = group_size
        self.padded_in = _round_up(self.in_features, group_size)
        padded = weight.new_zeros(_round_up(self.out_features, _INT4_ROWS_MULTIPLE), self.padded_in)
        padded[: self.out_features, : self.in_features] = weight
        codes, scale, zero = quantize_groups(padded, group_size)
        if packed:
            stored = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        else:
            stored = codes[:, 0::2] | (codes[:, 1::2] << 4)
        self.weight_int4: Tensor
        self.scale_and_zero: Tensor
        self.register_buffer("weight_int4", stored)  # uint8 [padded out, padded in / 2]
        # [groups, padded out, 2]: the kernel's layout, kept in the fallback too
        both = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scale_and_zero", both.to(weight.dtype))
        self.bias = linear.bias
        self.packed = packed
        """Multiply with `_weight_int4pack_mm_for_cpu` (else dequantise per call)."""

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.packed:
            if self.padded_in != self.in_features:
                flat = nn.functional.pad(flat, (0, self.padded_in - self.in_features))
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat.contiguous(), self.weight_int4, self.group_size,
                self.scale_and_zero.to(x.dtype),
            )  # fmt: skip
            out = out[:, : self.out_features]
        else:
            weight = self.dequantized(x.dtype)[: self.out_features, : self.in_features]
            out = flat @ weight.T
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        """The unpacked form's weight, padded: [padded out, padded in] in `dtype`."""
        if self.packed:
            raise ValueError("the packed layout is the kernel's: dequantise the unpacked form")
        low, high = self.weight_int4 & 15, self.weight_int4 >> 4
        codes = torch.stack([low, high], dim=-1).reshape(self.weight_int4.shape[0], -1)
        pairs = self.scale_and_zero.transpose(0, 1)  # [padded out, groups, 2]
        return dequantize_groups(codes, pairs[..., 0], pairs[..., 1], dtype)


def check_group_size(group_size: int) -> None:
    """Raises ValueError unless `group_size` is one the int4 kernel takes."""
    if group_size not in INT4_GROUP_SIZES:
        sizes = ", ".join(map(str, INT4_GROUP_SIZES))
        raise ValueError(f"int4 group size must be one of {sizes}, got {group_size}")


def quantize_groups(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric 4-bit per group of `group_size` input channels: (codes uint8 [out, in] in
    0..15, scale [out, in / group_size] float32, zero [out, in / group_size] float32) with
    weight ~ (codes - 8) * scale + zero. `in` must be a multiple of `group_size`."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"{in_features} input channels are not whole groups of {group_size}")
    w = weight.to(torch.float32).reshape(out_features, -1, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scale = (high - low).clamp(min=torch.finfo(torch.float32).tiny) / 15.0
    codes = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, 15)
    return codes.to(torch.uint8).reshape(out_features, in_features), scale, low + 8 * scale


def dequantize_groups(codes: Tensor, scale: Tensor, zero: Tensor, dtype: torch.dtype) -> Tensor:
    """`quantize_groups` undone in `dtype`: [out, in] from codes [out, in] and scale, zero
    [out, groups]."""
    group_size = codes.shape[1] // scale.shape[1]
    scale = scale.to(dtype).repeat_interleave(group_size, dim=1)
    zero = zero.to(dtype).repeat_interleave(group_size, dim=1)
    return (codes.to(dtype) - 8) * scale + zero


def int4_packed_mm_works(device: torch.device) -> bool:
    """Whether torch's CPU int4 kernels run on `device` (a small probe)."""
    try:
        codes = torch.zeros(_INT4_ROWS_MULTIPLE, 32, dtype=torch.int32, device=device)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        x = torch.ones(1, 32, dtype=torch.bfloat16, device=device)
        pairs = torch.ones(1, _INT4_ROWS_MULTIPLE, 2, dtype=torch.bfloat16, device=device)
        torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, pairs)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def activations_quantized(model: nn.Module) -> bool:
    """Whether `model` quantizes activations per call (`int8-dynamic`): a row's output then
    moves with the other rows of its batch (one activation scale per call)."""
    dynamic = torch.ao.nn.quantized.dynamic.Linear
    return any(isinstance(module, dynamic) for module in model.modules())


def output_width(model: nn.Module) -> int:
    """Width of the logits: the output head's features (its `weight` is a method once
    dynamically quantized, so its shape is not read); 0 without a head."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    if head is None:
        return 0
    features = getattr(head, "out_features", None)
    return int(features) if features is not None else int(head.weight.shape[0])


def _swap_linears(module: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child))
        else:
            _swap_linears(child, make)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
