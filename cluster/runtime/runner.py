"""Model runners: one forward pass for many sequences' new tokens, over block-accounted KV memory.

A step is a batch of `SequenceWork` items, one per sequence: tokens appended at the sequence's
current length (a decode, a verify block, a prefill chunk) and the indices of those tokens whose
next-token logits are wanted. `ModelRunner.forward` returns those logits as float32 rows in batch
order and appends the tokens; `truncate` rolls a sequence back without copying; `release` forgets
it. KV memory is counted in blocks of `block_size` tokens out of `num_blocks`: a step whose new
blocks do not fit raises `PoolExhaustedError` with nothing changed, so the caller can admit,
defer or preempt by blocks whatever runner it got. Those names, and `BlockAccountedRunner`, the
base every runner extends, live in `cluster.runtime.block_runner`, below model loading, so that
the simulated runner builds on them too; this module re-exports them.

- `PagedModelRunner`: every item in ONE model call, K/V in a `KVBlockPool` through the
  `tandem_paged` attention function. It switches the model object to that attention for good;
  plain calls of the model (`generate`, a full forward) still work, as SDPA.
- `SerialModelRunner`: the fallback for models that cannot switch attention (remote code,
  recurrent or hybrid models, attention sinks): a `DynamicCache` per sequence, one model call
  per item.
- `build_runner` sizes the memory and picks the runner with a load-time self-test (a simulated
  model gets `cluster.runtime.sim_model.SimModelRunner`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from cluster.runtime.block_runner import (
    BlockAccountedRunner,
    ModelRunner,
    SequenceWork,
)
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.kv_pool import (
    BlockAllocator,
    KVBlockPool,
    blocks_for,
    num_input_ids,
    pool_blocks,
)
from cluster.runtime.models import LoadedModel
from cluster.runtime.paged_attention import ATTENTION_NAME, BATCH_KWARG, pack_step
from cluster.runtime.quantize import activations_quantized
from cluster.runtime.sim_model import SimCausalLM, SimModelRunner

logger = logging.getLogger(__name__)


def split_rows(batch: Sequence[SequenceWork], logits: torch.Tensor) -> list[torch.Tensor]:
    """`forward`'s rows cut per item (views)."""
    return list(logits.split([len(w.logits_at) for w in batch]))


class PagedModelRunner(BlockAccountedRunner):
    """All items of a step in one model call, over a `KVBlockPool`."""

    kind = "paged"

    def __init__(self, model: PreTrainedModel, *, num_blocks: int, block_size: int = 16) -> None:
        model.set_attn_implementation(ATTENTION_NAME)
        if model.config._attn_implementation != ATTENTION_NAME:
            raise InvalidArgumentError(
                f"{type(model).__name__} cannot switch to a custom attention function"
            )
        self.pool = KVBlockPool.for_model(model, num_blocks=num_blocks, block_size=block_size)
        super().__init__(model, self.pool)

    @torch.inference_mode()
    def forward(self, batch: Sequence[SequenceWork]) -> torch.Tensor:
        """float32 `[sum(len(w.logits_at)), vocab]`, rows in batch order; appends the tokens.

        Raises `PoolExhaustedError` (nothing changed) if the new blocks do not fit; if the
        model call fails, the reservations are undone and the error propagates.
        """
        if not batch:
            return self._empty_logits()
        pool, device = self.pool, self.device
        pasts = [pool.length(w.seq_id) for w in batch]
        new_ids = self._reserve(batch)
        try:
            q_lens = [len(w.tokens) for w in batch]
            step = pack_step(
                key_cache=pool.key,
                value_cache=pool.value,
                block_tables=pool.block_tables([w.seq_id for w in batch]),
                block_size=pool.block_size,
                past_lengths=pasts,
                query_lengths=q_lens,
            )
            tokens = list(itertools.chain.from_iterable(w.tokens for w in batch))
            counts = torch.tensor([len(w.logits_at) for w in batch])
            starts = torch.cumsum(torch.tensor(q_lens), 0) - torch.tensor(q_lens)
            rows = torch.tensor(list(itertools.chain.from_iterable(w.logits_at for w in batch)))
            rows = (rows.long() + torch.repeat_interleave(starts, counts)).to(device)
            keep = {"logits_to_keep": rows} if self._keep_rows_in_model else {}
            logits = self.model(
                input_ids=torch.tensor([tokens], device=device),
                position_ids=step.positions[None],
                attention_mask=None,  # our attention name has no mask function: HF builds none
                use_cache=False,
                **keep,
                **{BATCH_KWARG: step},
            ).logits[0]
        except BaseException:
            pool.undo_reservations([w.seq_id for w in batch], new_ids)
            raise
        if not self._keep_rows_in_model:
            logits = logits[rows]
        for w, past in zip(batch, pasts, strict=True):
            pool.commit(w.seq_id, past + len(w.tokens))
        return logits.float()

    def truncate(self, seq_id: str, length: int) -> None:
        """Keep positions `< length`; whole blocks past it are freed; nothing is copied."""
        self.pool.truncate(seq_id, length)

    def release(self, seq_id: str) -> None:
        self.pool.release(seq_id)


class SerialModelRunner(BlockAccountedRunner):
    """One `DynamicCache` per sequence and one model call per item, accounted in blocks."""

    kind = "serial"

    def __init__(self, model: PreTrainedModel, *, num_blocks: int, block_size: int = 16) -> None:
        if model.config._attn_implementation == ATTENTION_NAME:
            raise InvalidArgumentError("this model object belongs to a PagedModelRunner")
        super().__init__(model, BlockAllocator(num_blocks=num_blocks, block_size=block_size))
        self._caches: dict[str, DynamicCache] = {}

    @torch.inference_mode()
    def forward(self, batch: Sequence[SequenceWork]) -> torch.Tensor:
        """Same contract as `PagedModelRunner.forward`, one model call per item."""
        if not batch:
            return self._empty_logits()
        pasts = [self._blocks.length(w.seq_id) for w in batch]
        new_ids = self._reserve(batch)
        rows: list[torch.Tensor] = []
        try:
            for w in batch:
                cache = self._caches.get(w.seq_id) or DynamicCache(config=self.model.config)
                self._caches[w.seq_id] = cache
                keep = torch.tensor(w.logits_at, dtype=torch.long, device=self.device)
                logits = self.model(
                    input_ids=torch.tensor([w.tokens], device=self.device),
                    past_key_values=cache,
                    use_cache=True,
                    **({"logits_to_keep": keep} if self._keep_rows_in_model else {}),
                ).logits[0]
                rows.append(logits if self._keep_rows_in_model else logits[keep])
        except BaseException:
            for w, past in zip(batch, pasts, strict=True):
                self._crop(w.seq_id, past)
            for seq_id in new_ids:
                self._caches.pop(seq_id, None)
            self._blocks.undo_reservations([w.seq_id for w in batch], new_ids)
            raise
        for w, past in zip(batch, pasts, strict=True):
            self._blocks.commit(w.seq_id, past + len(w.tokens))
        return torch.cat(rows).float()

    def _crop(self, seq_id: str, length: int) -> None:
        cache = self._caches.get(seq_id)
        if cache is None:
            return
        if length == 0:
            self._caches[seq_id] = DynamicCache(config=self.model.config)
            return
        # Layer by layer: after a model call that failed midway, the first layers hold more
        # positions than the last. Transformers' crop takes a negative count to remove.
        layers: list[Any] = list(cache.layers)
        for layer in layers:
            held = layer.get_seq_length()
            if held > length:
                layer.crop(length - held)

    def _forked(self, parent: str, child: str, length: int) -> None:
        cache = DynamicCache(config=self.model.config)
        held = self._caches.get(parent)
        layers: list[Any] = list(held.layers) if held is not None and length else []
        for index, layer in enumerate(layers):
            if getattr(layer, "keys", None) is None:
                if layer.get_seq_length() == 0:
                    break
                self._blocks.release(child)
                raise InvalidArgumentError(f"cannot fork a {type(layer).__name__} cache")
            keys, values = layer.keys[..., :length, :], layer.values[..., :length, :]
            cache.update(keys.clone(), values.clone(), index)
        self._caches[child] = cache

    def truncate(self, seq_id: str, length: int) -> None:
        """Keep positions `< length` (the cache is cropped); whole blocks past it are freed."""
        self._blocks.truncate(seq_id, length)
        self._crop(seq_id, length)

    def release(self, seq_id: str) -> None:
        self._blocks.release(seq_id)
        self._caches.pop(seq_id, None)


# --------------------------------------------------------------------------------------------- #
# Choosing and sizing a runner

_SELF_TEST_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
"""Largest max|Δlogit| / max(1, max|logit|) the self-test accepts; 5e-2 for 16-bit dtypes. A
wrong mask or ignored positions gives errors of order 1."""


def paged_self_test(model: PreTrainedModel, block_size: int) -> str | None:
    """Run two short sequences paged (a prefill, then a mixed step: a verify block across a
    block boundary plus a new prefill) against a plain full forward of the same model.

    Returns None when they match, the model then switched to `tandem_paged`; else the reason,
    the model's attention put back as it was.
    """
    if activations_quantized(model):
        return "activations quantized per call: a batch's rows would change each other's output"
    vocab = num_input_ids(model)
    a = [(i * 7919 + 13) % vocab for i in range(block_size + 3)]
    b = [(i * 104729 + 7) % vocab for i in range(5)]
    original = model.config._attn_implementation
    if original == ATTENTION_NAME:  # switched by an earlier runner: compare with plain SDPA
        model.set_attn_implementation("sdpa")
        original = "sdpa"
    with torch.inference_mode():  # the reference, before the switch
        reference = [model(torch.tensor([s], device=model.device)).logits[0] for s in (a, b)]
    split = max(1, block_size - 2)  # the verify block then crosses into the second block
    try:
        blocks = blocks_for(len(a), block_size) + blocks_for(len(b), block_size)
        runner = PagedModelRunner(model, num_blocks=blocks, block_size=block_size)
        first = runner.forward([SequenceWork("a", tuple(a[:split]), tuple(range(split)))])
        second = runner.forward(
            [
                SequenceWork("a", tuple(a[split:]), tuple(range(len(a) - split))),
                SequenceWork("b", tuple(b), tuple(range(len(b)))),
            ]
        )
        got = torch.cat([first, second])
        want = torch.cat(reference).float()
        tolerance = _SELF_TEST_TOLERANCE.get(model.dtype, 5e-2)
        # A trimmed head's -inf logits (cluster.runtime.vocab) must come out where they are,
        # and the error is measured over the finite ones.
        finite = torch.isfinite(want)
        if not torch.equal(got[~finite], want[~finite]):
            raise ValueError("the logits that are not finite differ")
        got, want = got[finite], want[finite]
        error = float((got - want).abs().max()) / max(1.0, float(want.abs().max()))
        reason = None if error <= tolerance else f"relative logit error {error:.2e} > {tolerance}"
    except Exception as exc:  # any failure means: not this runner
        reason = f"{type(exc).__name__}: {exc}"
    if reason is not None and model.config._attn_implementation != original:
        model.set_attn_implementation(original)
    return reason


def build_runner(
    model: LoadedModel,
    *,
    kv_cache_bytes: int = 0,
    kv_cache_fraction: float = 0.2,
    max_tokens_needed: int | None = None,
    block_size: int = 16,
    max_sequence_tokens: int | None = None,
) -> ModelRunner:
    """A runner over `model.model` with a pool of `kv_cache_bytes` (if > 0, else
    `kv_cache_fraction` of the device's free memory), capped at `max_tokens_needed` tokens and at
    least one `max_sequence_tokens` sequence (default: the model's context, capped at
    `max_tokens_needed`). Paged if `paged_self_test` passes, else serial; logs which and why."""
    num_blocks = pool_blocks(
        model.model,
        kv_cache_bytes=kv_cache_bytes,
        kv_cache_fraction=kv_cache_fraction,
        max_tokens_needed=max_tokens_needed,
        max_sequence_tokens=max_sequence_tokens,
        block_size=block_size,
    )
    name = type(model.model).__name__
    if isinstance(model.model, SimCausalLM):
        logger.info("%s: simulated device, %d blocks of %d tokens", name, num_blocks, block_size)
        return SimModelRunner(model.model, num_blocks=num_blocks, block_size=block_size)
    reason = paged_self_test(model.model, block_size)
    if reason is None:
        logger.info("%s: paged runner, %d blocks of %d tokens", name, num_blocks, block_size)
        return PagedModelRunner(model.model, num_blocks=num_blocks, block_size=block_size)
    logger.warning("%s: serial runner (paged self-test failed: %s)", name, reason)
    return SerialModelRunner(model.model, num_blocks=num_blocks, block_size=block_size)
