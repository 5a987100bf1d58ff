"""Per-sequence KV cache over a causal LM: prefill, forward a block, roll back.

`KVSession` remembers which token ids its cache holds. Asking it for the logits after a token
sequence reuses the longest cached prefix of that sequence, drops what disagrees (rollback) and
runs the model once over the rest, so drafter and verifier express what they need ("the next-token
logits after these tokens", "the logits of this block") and never track cache offsets by hand.
Both sides use this one class; it knows nothing of sampling, sessions or the network.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from verifier.runtime.errors import InvalidArgumentError


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences.

    Called on every forward with the whole context, so it compares list slices (a C loop)
    instead of stepping through tokens in Python: one comparison in the usual case, where one
    sequence extends the other, and a binary search over prefix lengths otherwise.
    """
    a, b = list(a), list(b)  # a list never equals a tuple: compare like with like
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low] and a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low


class KVSession:
    """The KV cache of one token sequence on one model."""

    def __init__(self, model: PreTrainedModel, device: torch.device) -> None:
        self._model = model
        self._device = device
        self._cache = DynamicCache(config=model.config)
        self._tokens: list[int] = []

    @property
    def num_cached_tokens(self) -> int:
        return len(self._tokens)

    @property
    def cached_tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    def rollback(self, length: int) -> None:
        """Forget every cached position from `length` on."""
        if length < 0:
            raise InvalidArgumentError(f"rollback length must be >= 0, got {length}")
        if length >= len(self._tokens):
            return
        if length == 0:
            self._cache = DynamicCache(config=self._model.config)
        else:
            # Transformers' crop takes the number of positions to remove, as a negative count.
            self._cache.crop(length - len(self._tokens))
        del self._tokens[length:]

    def logits(self, tokens: Sequence[int], num_logits: int) -> torch.Tensor:
        """Logits at the last `num_logits` positions of `tokens`: `[num_logits, vocab]`.

        Row i predicts the token after `tokens[len(tokens) - num_logits + i]`. Afterwards the
        cache holds exactly `tokens`.
        """
        if not 1 <= num_logits <= len(tokens):
            raise InvalidArgumentError(
                f"num_logits must be in 1..{len(tokens)} for {len(tokens)} tokens, got {num_logits}"
            )
        keep = min(common_prefix_length(self._tokens, tokens), len(tokens) - num_logits)
        self.rollback(keep)
        new_tokens = list(tokens[keep:])
        input_ids = torch.tensor([new_tokens], dtype=torch.long, device=self._device)
        with torch.inference_mode():
            output = self._model(
                input_ids=input_ids,
                past_key_values=self._cache,
                use_cache=True,
                logits_to_keep=num_logits,
            )
        self._tokens.extend(new_tokens)
        return output.logits[0, -num_logits:]

    def prefill(self, tokens: Sequence[int]) -> None:
        """Cache `tokens` ahead of time (reusing any cached prefix); no logits are kept."""
        if len(tokens) > 0:
            self.logits(tokens, num_logits=1)
