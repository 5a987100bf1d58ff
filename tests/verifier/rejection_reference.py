"""Shared by the rejection tests: small tensor helpers and a plain loop reference of the
acceptance rule with the module's draw protocol."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

Sampler = Callable[[Tensor, Tensor, Tensor | None, torch.Generator], tuple[Tensor, int]]


def token_ids(*token_ids: int) -> Tensor:
    return torch.tensor(token_ids, dtype=torch.int64)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def reference_rejection_sample(
    target_probs: Tensor,  # [k + 1, vocab]
    draft_tokens: Tensor,  # [k]
    draft_probs: Tensor | None,  # [k, vocab]
    generator: torch.Generator,
) -> tuple[Tensor, int]:
    """The rule, one position at a time, with the module's draw protocol."""
    k, vocab = len(draft_tokens), target_probs.shape[1]
    p = target_probs.float()
    q = torch.zeros(k, vocab) if draft_probs is None else draft_probs.float().clone()
    if draft_probs is None:
        for i in range(k):
            q[i, draft_tokens[i]] = 1.0
    u = torch.rand(k, generator=generator) if k > 0 else None
    emitted: list[int] = []
    for i in range(k):
        x = int(draft_tokens[i])
        assert u is not None
        if bool(u[i] < p[i, x] / q[i, x]):
            emitted.append(x)
            continue
        residual = torch.clamp(p[i] - q[i], min=0.0)
        row = residual if float(residual.sum()) > 0 else p[i]
        emitted.append(int(torch.multinomial(row, 1, generator=generator)))
        return torch.tensor(emitted), i
    emitted.append(int(torch.multinomial(p[k], 1, generator=generator)))
    return torch.tensor(emitted), k
