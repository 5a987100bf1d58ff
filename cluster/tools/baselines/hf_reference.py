"""Seed-exact output from plain Hugging Face generation: the ground truth a user can run alone.

`SeedExactProcessor` is a `transformers` logits processor. At each step it turns the scores into
the distribution Tandem samples from (`sampling.logits_to_probs`: temperature, top-k, top-p) and
replaces them with a score whose argmax is the seed-exact draw at that position
(`gumbel`: p(x) / E(seed, position, x), with -inf where p is 0). Greedy `generate` over those
scores then emits exactly the tokens Tandem's seed-exact rule emits for the same prompt, seed,
settings and target model, with no drafter, no engine and no batching: `reference_generate`.

`GrammarProcessor` masks each step's scores to the tokens a grammar allows, with llguidance
used directly (its own matcher and bitmask over the model's tokenizer, not Tandem's
`TokenMatcher`), and `MinTokensProcessor` forbids the end tokens before `min_tokens`: an
independent reference for constrained generation. They run before `SeedExactProcessor`, as
Tandem masks the target's logits before temperature, top-k and top-p.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import llguidance.hf
import llguidance.torch
import torch
from llguidance import LLMatcher
from torch import Tensor

from cluster.runtime.constraint import Grammar
from cluster.runtime.gumbel import exponential_row
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling import logits_to_probs
from cluster.runtime.sampling_params import SamplingParams


class SeedExactProcessor:
    """A `LogitsProcessor`: scores `[batch, vocab]` in, seed-exact scores out (one seed per
    batch row; the position of the next token is the row's input length)."""

    def __init__(self, sampling: SamplingParams, seeds: Sequence[int]) -> None:
        self.sampling = sampling
        self.seeds = tuple(seeds)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:  # [batch, len], [batch, vocab]
        probs = logits_to_probs(scores.float(), self.sampling)
        if self.sampling.is_greedy:
            return probs  # one-hot at the argmax: greedy generate keeps it
        position = input_ids.shape[1]
        vocab = scores.shape[1]
        rows = [
            probs[i].double().cpu() / exponential_row(seed, position, vocab)
            for i, seed in enumerate(self.seeds)
        ]
        out = torch.stack(rows).to(scores.device)
        # p = 0 gives a ratio of 0 where every kept token's is positive; -inf says so plainly.
        return out.masked_fill(probs == 0, -torch.inf)


class GrammarProcessor:
    """A `LogitsProcessor` for one sequence (batch 1): the scores of every token `grammar`
    forbids after the tokens generated so far (those past `prompt_length`) set to -inf. Once
    the grammar is complete only the end tokens are allowed."""

    def __init__(
        self,
        target: LoadedModel,
        grammar: Grammar,
        prompt_length: int,
        eos_token_ids: Collection[int],
    ) -> None:
        self._width = target.vocab_size
        tokenizer = llguidance.hf.from_tokenizer(
            target.tokenizer,  # type: ignore[arg-type]
            n_vocab=self._width,
            eos_token=sorted(eos_token_ids),
        )
        self._matcher = LLMatcher(tokenizer, grammar.compiled(), log_level=0)
        if self._matcher.is_error():
            raise ValueError(f"grammar does not compile: {self._matcher.get_error()}")
        self._prompt_length = prompt_length
        self._consumed = 0
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, self._width)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:  # [1, len], [1, vocab]
        generated = input_ids[0, self._prompt_length + self._consumed :].tolist()
        for token in generated:
            if not self._matcher.consume_token(int(token)):
                raise ValueError(f"the grammar refused token {token}: {self._matcher.get_error()}")
        self._consumed += len(generated)
        llguidance.torch.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        masked = scores.float().cpu().clone()
        llguidance.torch.apply_token_bitmask_inplace(masked, self._bitmask)
        return masked.to(scores.device)


class MinTokensProcessor:
    """A `LogitsProcessor`: the scores of `end_token_ids` set to -inf until `min_tokens`
    tokens follow the prompt (`prompt_length` tokens)."""

    def __init__(self, prompt_length: int, min_tokens: int, end_token_ids: Collection[int]):
        self._until = prompt_length + min_tokens
        self._ends = sorted(end_token_ids)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:  # [batch, len], [batch, vocab]
        if input_ids.shape[1] >= self._until or not self._ends:
            return scores
        masked = scores.clone()
        masked[:, self._ends] = -torch.inf
        return masked


def reference_generate(
    target: LoadedModel,
    prompt_tokens: Sequence[int],
    max_tokens: int,
    sampling: SamplingParams,
    seed: int,
    eos_token_ids: Collection[int] = (),
    *,
    grammar: Grammar | None = None,
    min_tokens: int = 0,
    stop_token_ids: Collection[int] = (),
) -> tuple[int, ...]:
    """The target's seed-exact output for one request by `model.generate` alone: greedy search
    over `SeedExactProcessor`'s scores, stopping after `max_tokens` or at one of `eos_token_ids`
    or `stop_token_ids`. Under `grammar` and `min_tokens` the scores are first masked by
    `GrammarProcessor` and `MinTokensProcessor` (the end tokens and `stop_token_ids`)."""
    model: Any = target.model  # transformers' `generate` is opaque to type checkers
    ends = sorted({*eos_token_ids, *stop_token_ids})
    processors: list[Any] = []
    if grammar is not None:
        processors.append(GrammarProcessor(target, grammar, len(prompt_tokens), eos_token_ids))
    if min_tokens > 0:
        processors.append(MinTokensProcessor(len(prompt_tokens), min_tokens, ends))
    processors.append(SeedExactProcessor(sampling, [seed]))
    inputs = torch.tensor([list(prompt_tokens)], device=target.device)
    with torch.inference_mode():
        output = model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=max_tokens,
            min_new_tokens=0,
            do_sample=False,
            num_beams=1,
            logits_processor=processors,
            eos_token_id=ends or None,
            pad_token_id=min(ends, default=0),
            temperature=None,
            top_p=None,
            top_k=None,
        )
    return tuple(int(t) for t in output[0, inputs.shape[1] :])
