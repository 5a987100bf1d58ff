"""Seed-exact output from plain Hugging Face generation: the ground truth a user can run alone.

`SeedExactProcessor` is a `transformers` logits processor. At each step it turns the scores into
the distribution Tandem samples from (`sampling.logits_to_probs`: temperature, top-k, top-p) and
replaces them with a score whose argmax is the seed-exact draw at that position
(`gumbel`: p(x) / E(seed, position, x), with -inf where p is 0). Greedy `generate` over those
scores then emits exactly the tokens Tandem's seed-exact rule emits for the same prompt, seed,
settings and target model, with no drafter, no engine and no batching: `reference_generate`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import Tensor

from cluster.runtime.gumbel import exponential_row
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling import SamplingParams, logits_to_probs


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


def reference_generate(
    target: LoadedModel,
    prompt_tokens: Sequence[int],
    max_tokens: int,
    sampling: SamplingParams,
    seed: int,
    eos_token_ids: Collection[int] = (),
) -> tuple[int, ...]:
    """The target's seed-exact output for one request by `model.generate` alone: greedy search
    over `SeedExactProcessor`'s scores, stopping after `max_tokens` or at one of `eos_token_ids`."""
    model: Any = target.model  # transformers' `generate` is opaque to type checkers
    inputs = torch.tensor([list(prompt_tokens)], device=target.device)
    with torch.inference_mode():
        output = model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=max_tokens,
            min_new_tokens=0,
            do_sample=False,
            num_beams=1,
            logits_processor=[SeedExactProcessor(sampling, [seed])],
            eos_token_id=list(eos_token_ids) or None,
            pad_token_id=min(eos_token_ids, default=0),
            temperature=None,
            top_p=None,
            top_k=None,
        )
    return tuple(int(t) for t in output[0, inputs.shape[1] :])
