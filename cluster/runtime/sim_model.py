"""A simulated model as a loaded model: `SimCausalLM`, its tokenizer, and `SimModelRunner`.

`sim://` sources (`cluster.runtime.sim`) load as a `SimCausalLM`: a `PreTrainedModel` with no
weights to speak of whose forward pass returns `sim_logits` for every position (so a plain full
forward is the reference a test compares against), and whose runner replaces only the forward
pass of a step. The runner keeps each sequence's tokens in blocks accounted as the paged
runner's are (`cluster.runtime.block_runner.BlockAccountedRunner`, the base of both: admission,
rollback and refusal behave the same), computes the wanted rows, then waits out the rest of the
modelled device time, sleeping as a host thread does while a GPU kernel runs, so the CPU is left
to the system's own work.

Dependencies: this module builds on `cluster.runtime.block_runner`, never on
`cluster.runtime.runner`, so that `cluster.runtime.models` loads `sim://` sources through it
and `cluster.runtime.runner.build_runner` picks its runner, both with plain module-level imports.

The tokenizer is byte-level (ids 0..255 are bytes, 256 ends a text) with the rest of the
vocabulary as short words, so prompts encode as bytes and generated ids decode to readable text.
"""

from __future__ import annotations

import string
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import (
    GenerationMixin,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)
from transformers.modeling_outputs import CausalLMOutput

from cluster.runtime import tiny
from cluster.runtime.block_runner import BlockAccountedRunner, SequenceWork
from cluster.runtime.kv_pool import BlockAllocator
from cluster.runtime.sim import sim_logits, tail_table
from cluster.runtime.sim_source import (
    END_OF_TEXT_ID,
    FIRST_WORD_ID,
    NUM_BYTES,
    DeviceProfile,
    SimSource,
)

_LETTERS = string.ascii_lowercase


class SimConfig(PretrainedConfig):
    """What a simulated model is: its source's fields. The KV shape is a token's worth of
    bookkeeping (a few hundred bytes), so pools size by blocks as for a real model."""

    model_type = "tandem-sim"

    def __init__(
        self,
        role: str = "target",
        profile_name: str = "instant",
        alpha: float = 1.0,
        sim_seed: int = 0,
        vocab_size: int = 32_000,
        **kwargs: Any,
    ) -> None:
        self.role = role
        self.profile_name = profile_name
        self.alpha = alpha
        self.sim_seed = sim_seed
        self.vocab_size = vocab_size
        self.num_hidden_layers = 1
        self.num_attention_heads = 1
        self.num_key_value_heads = 1
        self.head_dim = 64
        self.hidden_size = 64
        self.max_position_embeddings = 1 << 20
        kwargs.setdefault("eos_token_id", END_OF_TEXT_ID)
        kwargs.setdefault("pad_token_id", END_OF_TEXT_ID)
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


class SimCausalLM(PreTrainedModel, GenerationMixin):
    """The simulated causal LM: logits are `sim_logits` of (last two tokens, position)."""

    config_class = SimConfig
    base_model_prefix = "sim"

    def __init__(self, config: SimConfig) -> None:
        super().__init__(config)
        # One-wide stand-ins: shapes (vocabulary, device, dtype) are read from them.
        self.embed = torch.nn.Embedding(config.vocab_size, 1)
        self.head = torch.nn.Linear(1, config.vocab_size, bias=False)
        # On the host whatever the device: rows are built there (`sim_logits`), then moved.
        self._table = tail_table(config.vocab_size, config.sim_seed)
        # Read once: a transformers config's attribute access is slow for a per-step path.
        self._seed = int(config.sim_seed)
        self._alpha = float(config.alpha) if config.role == "draft" else None
        self.post_init()

    @classmethod
    def from_source(cls, source: SimSource) -> SimCausalLM:
        alpha = source.alpha if source.role == "draft" else 1.0
        config = SimConfig(source.role, source.profile_name, alpha, source.seed, source.vocab_size)
        model = cls(config)
        model.generation_config.eos_token_id = END_OF_TEXT_ID
        model.generation_config.pad_token_id = END_OF_TEXT_ID
        return model.eval()

    def _init_weights(self, module: torch.nn.Module) -> None:
        return  # nothing is learned: the logits come from the seeded table

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head

    @property
    def profile(self) -> DeviceProfile:
        return SimSource(self.config.role, self.config.profile_name).profile

    def rows(
        self, previous: Sequence[int], current: Sequence[int], positions: Sequence[int]
    ) -> torch.Tensor:
        """[n, vocab] next-token logits (see `sim_logits`) on the model's device, in its dtype
        (float32 on the CPU, as the sim presets load it: no copy)."""
        logits = sim_logits(self._table, self._seed, previous, current, positions, self._alpha)
        weight = self.head.weight
        return logits.to(device=weight.device, dtype=weight.dtype)

    def forward(self, input_ids: torch.Tensor, **_: Any) -> CausalLMOutput:
        """Logits at every position of `input_ids` [batch, length], with no cache and no
        modelled time: the reference a runner's output is checked against."""
        batch, length = input_ids.shape
        ids = input_ids.long().cpu()
        previous = torch.cat([torch.full((batch, 1), -1), ids[:, :-1]], 1)
        positions = torch.arange(length).expand(batch, -1)
        logits = self.rows(
            previous.reshape(-1).tolist(), ids.reshape(-1).tolist(), positions.reshape(-1).tolist()
        )
        return CausalLMOutput(logits=logits.view(batch, length, -1).to(input_ids.device))


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Bytes, end of text, then one word per remaining id (" a", " b", ..., " ba", ...)."""
    assert NUM_BYTES == tiny.NUM_BYTES and END_OF_TEXT_ID == tiny.END_OF_TEXT_ID
    words = [" " + _word(i) for i in range(vocab_size - FIRST_WORD_ID)]
    return tiny.build_tokenizer(words)


def _word(index: int) -> str:
    letters = ""
    index += 1
    while index:
        index, rest = divmod(index - 1, len(_LETTERS))
        letters = _LETTERS[rest] + letters
    return letters


class SimModelRunner(BlockAccountedRunner):
    """A step's rows from `SimCausalLM.rows`, after the modelled device time has passed."""

    kind = "sim"

    def __init__(
        self,
        model: SimCausalLM,
        *,
        num_blocks: int,
        block_size: int = 16,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        super().__init__(model, BlockAllocator(num_blocks=num_blocks, block_size=block_size))
        self.sim = model
        self.profile = model.profile
        self._tokens: dict[str, list[int]] = {}
        self._sleep, self._clock = sleep, clock
        self.device_s = 0.0
        """Modelled seconds of every step so far."""
        self.max_step_tokens = self.profile.max_step_tokens
        self.max_step_sequences = self.profile.max_step_sequences
        """The device's own step budget (a replica's config may set its own)."""

    def modelled_s(self, batch: Sequence[SequenceWork]) -> float:
        """The modelled time of a step over `batch`, before it runs."""
        tokens = sum(len(w.tokens) for w in batch)
        attended = sum(self._blocks.length(w.seq_id) + len(w.tokens) for w in batch)
        return self.profile.step_s(tokens, attended)

    def forward(self, batch: Sequence[SequenceWork]) -> torch.Tensor:
        """Same contract as `PagedModelRunner.forward`; returns once the modelled time is up."""
        started = self._clock()
        if not batch:
            return self._empty_logits()
        modelled = self.modelled_s(batch)
        pasts = [self._blocks.length(w.seq_id) for w in batch]
        self._reserve(batch)
        previous: list[int] = []
        current: list[int] = []
        positions: list[int] = []
        for w, past in zip(batch, pasts, strict=True):
            held = self._tokens.setdefault(w.seq_id, [])
            del held[past:]  # positions past the committed length were rolled back
            held.extend(w.tokens)
            for i in w.logits_at:
                at = past + i
                previous.append(held[at - 1] if at else -1)
                current.append(held[at])
                positions.append(at)
            self._blocks.commit(w.seq_id, past + len(w.tokens))
        logits = self.sim.rows(previous, current, positions)
        self.device_s += modelled
        left_s = started + modelled - self._clock()
        if left_s > 0:
            self._sleep(left_s)
        return logits

    def _forked(self, parent: str, child: str, length: int) -> None:
        self._tokens[child] = self._tokens.get(parent, [])[:length]

    def truncate(self, seq_id: str, length: int) -> None:
        self._blocks.truncate(seq_id, length)
        held = self._tokens.get(seq_id)
        if held is not None:
            del held[length:]

    def release(self, seq_id: str) -> None:
        self._blocks.release(seq_id)
        self._tokens.pop(seq_id, None)
