"""A cheaper draft: int8 weights for a model's Linear layers, per output channel.

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

Measured on the 2-core AVX-512 CPU (VNNI, no AMX), one intra-op thread, the 0.5B
Qwen2.5-Coder draft decoding one token with a KV cache (median of 24 steps; greedy output equal
to bf16's on all 24): bf16 138 ms/token, fp32 145; `int8` in bf16 86; `int8-dynamic` 51 (per
tensor weights 52); a per-row dynamic variant over `torch._int_mm` 100; torchao 0.18's
`Int8WeightOnlyConfig` in bf16 319 and `Int8DynamicActivationInt8WeightConfig` in fp32 539.
torchao is the slowest here, so the project uses torch's own kernels and does not depend on it.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from cluster.runtime.model_spec import check_quantization


def compute_dtype(quantization: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the model's unquantized parts run in: float32 under `int8-dynamic` (its kernels
    take float32 activations), else `dtype`."""
    return torch.float32 if quantization == "int8-dynamic" else dtype


def quantize_weights(model: nn.Module, quantization: str, device: torch.device) -> nn.Module:
    """Quantize `model`'s Linear layers in place (on `device`, already cast); returns it."""
    check_quantization(quantization)
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
    _swap_linears(model, packed_mm_works(device))
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


def _swap_linears(module: nn.Module, packed: bool) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8WeightOnlyLinear(child, packed))
        else:
            _swap_linears(child, packed)
