"""The output step: which of a verdict's committed tokens reach the caller, as what text, and
whether the output ends with them.

An output ends, finish reason stop, at the first end token at output position `min_tokens` or
later (end-of-sequence unless the request ignores it, or one of its `stop_token_ids`), or at a
stop string (`cluster.routing.text`); otherwise, finish reason length, once `max_tokens` are
out. As in vLLM, an end token is the output's last token but its text is left out (vLLM does not
decode it), so a stop token id never shows in the text. Where a stop string ends the output, the
tokens and text kept are those `cluster.routing.text` keeps.

Pure bookkeeping over a `Generation`, no I/O: the router calls `emit` once per verdict.
"""

from __future__ import annotations

from collections.abc import Sequence

from cluster.routing.generation import Decode, Generation
from cluster.routing.request import FinishReason, GenerationChunk, GenerationRequest
from cluster.runtime.errors import InvalidArgumentError


def emit(gen: Generation, tokens: Sequence[int], eos_token_ids: frozenset[int]) -> GenerationChunk:
    """Put newly committed `tokens` in the output, applying end tokens and stop strings."""
    request = gen.request
    left = request.max_tokens - gen.text.num_tokens
    new_tokens = list(tokens[:left])
    end = end_at(request, gen.text.num_tokens, new_tokens, eos_token_ids)
    text_tokens = new_tokens if end is None else new_tokens[:end]
    step = gen.text.add(text_tokens)
    text = step.text
    finish: FinishReason | None = None
    if step.stopped:
        finish = FinishReason.STOP
        tokens = text_tokens[: step.num_tokens_kept]
    else:
        if end is not None:
            finish = FinishReason.STOP
        elif gen.text.num_tokens >= request.max_tokens:
            finish = FinishReason.LENGTH
        tokens = new_tokens[: len(text_tokens) + (end is not None)]
        if finish is not None:
            text += gen.text.finish()
    return GenerationChunk(tokens=tuple(tokens), text=text, finish_reason=finish)


def end_at(
    request: GenerationRequest,
    num_before: int,
    tokens: Sequence[int],
    eos_token_ids: frozenset[int],
) -> int | None:
    """Where in `tokens` (which follow `num_before` output tokens) the first end token that
    may end the output stands; None if none does."""
    stop_ids = frozenset(request.stop_token_ids)
    eos = frozenset() if request.ignore_eos else eos_token_ids
    first = max(request.min_tokens - num_before, 0)  # before it, end tokens do not end
    return next(
        (i for i in range(first, len(tokens)) if tokens[i] in eos or tokens[i] in stop_ids),
        None,
    )


def decode_for(request: GenerationRequest, decode: Decode, decode_special: Decode | None) -> Decode:
    """The decode function of `request`'s text: special tokens left out (`decode`), or kept
    (`decode_special`; None: such a request is INVALID_ARGUMENT)."""
    if request.skip_special_tokens:
        return decode
    if decode_special is None:
        raise InvalidArgumentError(
            "skip_special_tokens false is not supported by this router: it has no "
            "decode function that keeps special tokens"
        )
    return decode_special
