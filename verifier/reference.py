"""Replay a served request through the plain target: the token it would have chosen at each step.

Contract: `replay` takes the target model, a request's prompt and the tokens the service emitted
for it, and runs one plain forward pass of the Hugging Face module over prompt + served tokens
(batch of one, no drafter, no engine, no batching with other requests), in chunks that share the
model's own KV cache. At served position i the row it reads is the logits after
prompt + served[:i] (teacher forcing: every position is checked on the prefix the service really
had, so a position after a mismatch is still a fair check). From that row it takes the token the
request's rule picks:

- greedy (temperature 0): the argmax, the lowest id on a tie;
- seed-exact: argmax over x of p(x) / E(seed, t, x) (`cluster.runtime.gumbel`), where p is the
  distribution actually sampled (`sampling.logits_to_probs`) and t = len(prompt) + i.

Both are functions of (prompt, seed, settings, target) alone, so the served output can be
audited token by token. A rejection-rule sampled request cannot (its tokens depend on the draw
order): `replay` refuses it, and the statistical audit (`cluster.tools.audit.stats`) covers it.

Scores, whose gaps say how close a call was: the raw logits for greedy; log(p(x) / E(x)) =
log p(x) - log E(x) for seed-exact (-inf where p is 0). No Ray, no gRPC: a replica and the CLI
both call this. `fp32_copy` gives a float32 copy of a model served in a lower precision.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from cluster.runtime.audit import Replay
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.gumbel import exponential_row, gumbel_tokens
from cluster.runtime.models import DTYPES, LoadedModel
from cluster.runtime.sampling import logits_to_probs
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.token_choice import greedy_tokens

DEFAULT_CHUNK_TOKENS = 64


def model_dtype(target: LoadedModel) -> str:
    """The name of the dtype `target` computes in ("float32", "bfloat16", "float16")."""
    dtype = next(target.model.parameters()).dtype
    return next((name for name, d in DTYPES.items() if d == dtype), str(dtype).split(".")[-1])


def fp32_copy(target: LoadedModel) -> LoadedModel:
    """`target` itself when it is float32, else a deep copy upcast to float32 (the same weights,
    rounded to nothing further), on the same device, sharing the tokenizer. For a replica that
    serves in bf16 and must replay in fp32; it costs the model's size again, in fp32."""
    if model_dtype(target) == "float32":
        return target
    model = copy.deepcopy(target.model)
    torch.nn.Module.to(model, dtype=torch.float32)  # parameter by parameter: a small peak
    model.eval()
    return LoadedModel(model=model, tokenizer=target.tokenizer, device=target.device)


def replay(
    target: LoadedModel,
    prompt_tokens: Sequence[int],
    served_tokens: Sequence[int],
    sampling: SamplingParams,
    seed: int,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    before_chunk: Callable[[], None] | None = None,
) -> Replay:
    """The plain target's choice at each of `served_tokens`' positions (module docstring).

    `chunk_tokens`: tokens per forward call; the result does not depend on it beyond float
    rounding. `before_chunk`: called before each forward call (a replica waits there while
    user traffic is queued). InvalidArgumentError for a rejection-rule sampled request, an
    empty prompt, a token id outside the vocabulary or `chunk_tokens < 1`."""
    if not sampling.is_greedy and not sampling.seed_exact:
        raise InvalidArgumentError(
            "this request was sampled by the rejection rule: only greedy or seed-exact requests "
            "can be replayed token by token; use the statistical mode"
        )
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise InvalidArgumentError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    prompt, served = [int(t) for t in prompt_tokens], [int(t) for t in served_tokens]
    if not prompt:
        raise InvalidArgumentError("a replay needs a prompt of at least one token")
    vocab = target.vocab_size
    bad = next((t for t in (*prompt, *served) if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidArgumentError(
            f"token id {bad} is outside the target's vocabulary 0..{vocab - 1}"
        )
    dtype = model_dtype(target)
    if not served:
        return Replay((), (), dtype, ())
    tokens: list[int] = []
    gaps: list[float] = []
    served_gaps: list[float] = []
    for first, logits in _served_rows(target, prompt, served, chunk_tokens, before_chunk):
        rows = logits.float()  # [m, vocab]; bf16 -> fp32 is exact, so ties stay ties
        positions = range(len(prompt) + first, len(prompt) + first + rows.shape[0])
        # The greedy score is the logit; the seed-exact one is read off the distribution drawn.
        weights = rows if sampling.is_greedy else logits_to_probs(rows, sampling)  # [m, vocab]
        chosen = (
            greedy_tokens(rows)
            if sampling.is_greedy
            else gumbel_tokens(weights, [seed] * len(positions), list(positions))
        )
        for row, (token, position) in enumerate(zip(chosen, positions, strict=True)):
            scores = _scores(weights[row], sampling, seed, position)  # [vocab] float64
            best = float(scores[token])
            served_token = served[position - len(prompt)]
            served_score = float(scores[served_token])
            scores[token] = -math.inf
            gaps.append(_difference(best, float(scores.max())))
            served_gaps.append(0.0 if served_token == token else _difference(best, served_score))
        tokens.extend(chosen)
    return Replay(tuple(tokens), tuple(gaps), dtype, tuple(served_gaps))


def _difference(best: float, other: float) -> float:
    """best - other, +inf when `other` is -inf (a token that cannot be chosen)."""
    return math.inf if other == -math.inf else best - other


def _scores(weights: Tensor, sampling: SamplingParams, seed: int, position: int) -> Tensor:
    """The rule's score of every token from one row's logits (greedy) or distribution
    (seed-exact): float64 `[vocab]` (module docstring)."""
    if sampling.is_greedy:
        return weights.double().cpu()
    noise = exponential_row(seed, position, weights.shape[0])  # [vocab] float64
    return weights.double().cpu().log() - noise.log()  # -inf where p is 0


def _served_rows(
    target: LoadedModel,
    prompt: list[int],
    served: list[int],
    chunk_tokens: int,
    before_chunk: Callable[[], None] | None,
) -> Iterator[tuple[int, Tensor]]:
    """Yield (i, logits `[m, vocab]`): the rows predicting served[i : i + m], chunk by chunk.

    The input is prompt + served[:-1] (nothing predicts past the last served token); the row
    predicting served[i] is the one at input index len(prompt) - 1 + i."""
    model: Any = target.model  # transformers' call signature is opaque to type checkers
    sequence = prompt + served[:-1]
    first_row = len(prompt) - 1  # the input index whose logits predict served[0]
    # A model without a KV cache (a simulated device's) takes the whole sequence at once.
    parameters = inspect.signature(model.forward).parameters
    cached = "past_key_values" in parameters
    step = chunk_tokens if cached else len(sequence)
    keep_rows = "logits_to_keep" in parameters
    cache = _new_cache(model) if cached else None
    with torch.inference_mode():
        for start in range(0, len(sequence), step):
            end = min(start + step, len(sequence))
            if before_chunk is not None:
                before_chunk()
            wanted = end - max(start, first_row)  # rows of this chunk that predict served tokens
            options: dict[str, Any] = {}
            if cached:
                options.update(past_key_values=cache, use_cache=True)
            if keep_rows:
                options["logits_to_keep"] = max(wanted, 1)  # 0 would mean every row
            inputs = torch.tensor([sequence[start:end]], device=target.device)
            logits = model(input_ids=inputs, **options).logits[0]  # [rows kept, vocab]
            if wanted > 0:
                yield max(start, first_row) - first_row, logits[-wanted:]


def _new_cache(model: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)
