"""The `tandem_paged` attention function and the per-step index tensors it reads.

The model keeps running its own modules (embeddings, RoPE, projections, norms, MLP, head); only
the attention *function* is ours, registered at import through transformers' public
`AttentionInterface` under `ATTENTION_NAME`. Our function applies its own masks and ignores the
one the model builds.

A switched model still serves plain calls (`generate`, a full forward, a `DynamicCache`): without
the step argument the function is transformers' own SDPA attention, and the name is registered
with SDPA's mask function too, so those calls get the mask they always had. So one loaded model
can back a runner and anything else in the process (a reference, a baseline) at once.

One forward pass takes a flattened ragged batch of new tokens (`[1, T]`: any mix of decodes,
verify blocks and prefill chunks). `pack_step` builds, once per step, a `PackedStep` that rides
down to every attention call as the `BATCH_KWARG` keyword argument of `model(...)`. In each layer
`paged_attention_forward` writes the new tokens' K/V into the pool at their slots, gathers each
sequence's whole context (`[B, kv_heads, k_max, head_dim]`), attends with SDPA under a causal
mask aligned to each sequence's own past (so several queries per sequence work), and un-pads the
result back to `[1, T, heads, head_dim]`. Sliding windows follow transformers' rule (key `j` is
seen from position `p` when `j > p - window`), with one mask per window size cached per step;
logit soft-capping (Gemma 2) takes a small manual path; attention sinks are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_NAME = "tandem_paged"
BATCH_KWARG = "tandem_step"
"""The `model(...)` keyword argument that carries the `PackedStep` to every attention call."""


@dataclass(frozen=True)
class PackedStep:
    """What every attention call of one step reads (all tensors on the model's device)."""

    key_cache: torch.Tensor  # [layers, slots, kv_heads, head_dim], the pool's storage
    value_cache: torch.Tensor
    write_slots: torch.Tensor  # [T] flat slot of each new token
    query_index: torch.Tensor  # [B, q_max] index into the T new tokens (padding -> 0)
    kv_slots: torch.Tensor  # [B, k_max] slots of each sequence's whole context (padding -> 0)
    query_positions: torch.Tensor  # [B, q_max] absolute position of each query (padding -> 0)
    unpad_index: torch.Tensor  # [T] row of each new token in the [B * q_max] padded layout
    positions: torch.Tensor  # [T] absolute position of each new token (the model's position_ids)
    mask: torch.Tensor  # [B, 1, q_max, k_max] bool, True = attend (causal)
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, sliding_window: int | None) -> torch.Tensor:
        """The causal mask, narrowed to keys `j > position - sliding_window` when a window is
        given; built at most once per step per window size."""
        if sliding_window is None:
            return self.mask
        cached = self._window_masks.get(sliding_window)
        if cached is None:
            keys = torch.arange(self.mask.shape[-1], device=self.mask.device)
            inside = keys[None, None, :] > self.query_positions[:, :, None] - sliding_window
            cached = self.mask & inside[:, None]
            self._window_masks[sliding_window] = cached
        return cached


def pack_step(
    *,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    past_lengths: Sequence[int],
    query_lengths: Sequence[int],
) -> PackedStep:
    """Index tensors of one step, built on the CPU from per-sequence sizes (no loop per token)
    and moved to the storage's device in one copy.

    `block_tables[b]` (int64, CPU, padded) must already hold room for `past_lengths[b] +
    query_lengths[b]` positions of sequence b; the new tokens of sequence b are the
    `query_lengths[b]` consecutive entries of the flattened batch after those of sequence b - 1.
    """
    batch = len(query_lengths)
    q_lens = torch.tensor(query_lengths, dtype=torch.long)
    pasts = torch.tensor(past_lengths, dtype=torch.long)
    total, q_max = int(q_lens.sum()), int(q_lens.max())
    k_max = int((pasts + q_lens).max())
    starts = torch.cumsum(q_lens, 0) - q_lens  # first flat index of each sequence's new tokens

    # Per new token: its sequence, its index within the sequence's new tokens, its position.
    seq_of = torch.repeat_interleave(torch.arange(batch), q_lens, output_size=total)
    index_in_seq = torch.arange(total) - starts[seq_of]
    positions = pasts[seq_of] + index_in_seq
    write_slots = block_tables[seq_of, positions // block_size] * block_size
    write_slots += positions % block_size
    unpad_index = seq_of * q_max + index_in_seq

    # Padded per-sequence layouts. Padding queries sit at position 0 and see key 0 only (a
    # finite softmax; their rows are dropped); padding keys lie past every query's position.
    cols_q = torch.arange(q_max)
    real_q = cols_q[None, :] < q_lens[:, None]
    query_index = torch.where(real_q, starts[:, None] + cols_q[None, :], 0)
    query_positions = torch.where(real_q, pasts[:, None] + cols_q[None, :], 0)
    cols_k = torch.arange(k_max)
    kv_blocks = block_tables[:, cols_k // block_size]  # the widest table covers k_max
    kv_slots = kv_blocks * block_size + cols_k % block_size
    kv_slots = torch.where(cols_k[None, :] < (pasts + q_lens)[:, None], kv_slots, 0)

    # One host-to-device copy for every index tensor, then views.
    parts = (write_slots, query_index, kv_slots, query_positions, unpad_index, positions)
    flat = torch.cat([p.reshape(-1) for p in parts]).to(key_cache.device)
    split = flat.split([p.numel() for p in parts])
    write_d, query_d, kv_d, qpos_d, unpad_d, pos_d = (
        s.view(p.shape) for s, p in zip(split, parts, strict=True)
    )
    keys = torch.arange(k_max, device=key_cache.device)
    mask = (keys[None, None, :] <= qpos_d[:, :, None])[:, None]  # [B, 1, q_max, k_max]
    return PackedStep(
        key_cache=key_cache,
        value_cache=value_cache,
        write_slots=write_d,
        query_index=query_d,
        kv_slots=kv_d,
        query_positions=qpos_d,
        unpad_index=unpad_d,
        positions=pos_d,
        mask=mask,
    )


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, T, head_dim], RoPE applied
    key: torch.Tensor,  # [1, kv_heads, T, head_dim], RoPE applied
    value: torch.Tensor,  # [1, kv_heads, T, head_dim]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over the paged pool (see module docstring)."""
    step = kwargs.get(BATCH_KWARG)
    if not isinstance(step, PackedStep):  # a plain call of a switched model: plain SDPA
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if getattr(module, "sinks", None) is not None:
        raise NotImplementedError("attention sinks are not supported by the paged runner")
    layer = int(module.layer_idx)  # type: ignore[arg-type]  # set by every HF attention module
    k_pool, v_pool = step.key_cache[layer], step.value_cache[layer]
    # Write the new tokens' K/V into their slots, then read each sequence's whole context back.
    k_pool.index_copy_(0, step.write_slots, key[0].transpose(0, 1).to(k_pool.dtype))
    v_pool.index_copy_(0, step.write_slots, value[0].transpose(0, 1).to(v_pool.dtype))
    k = k_pool[step.kv_slots].transpose(1, 2)  # [B, kv_heads, k_max, head_dim]
    v = v_pool[step.kv_slots].transpose(1, 2)
    q = query[0][:, step.query_index].transpose(0, 1)  # [B, heads, q_max, head_dim]
    mask = step.mask_for(kwargs.get("sliding_window"))
    softcap = kwargs.get("softcap")
    if softcap is None:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]
        )  # [B, heads, q_max, head_dim]
    else:  # logit soft-capping (Gemma 2): SDPA cannot express it
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        scores = torch.tanh(q @ k.transpose(-1, -2) * scale / softcap) * softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
    batch, heads, q_max, head_dim = out.shape
    out = out.transpose(1, 2).reshape(batch * q_max, heads, head_dim)[step.unpad_index]
    return out.unsqueeze(0), None  # [1, T, heads, head_dim], as HF attention functions return


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
