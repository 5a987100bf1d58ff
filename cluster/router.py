"""The router: owns a request's committed tokens and runs the draft/verify loop.

The router is the single source of truth for a request's token history (DESIGN.md): replicas
hold only caches of it. Per round it asks the drafter for a block of `k` tokens based on the
committed length, sends the block to the verifier, commits the verdict's tokens, and streams
them. `k` never exceeds what is left of `max_tokens` minus the one token every verify pass
emits itself, so no verified work is thrown away at the end. With `draft_tokens = 0` the
drafter is never called: each round verifies an empty block, which is plain target decoding
through the same path.

The router depends only on the `DrafterPort` and `VerifierPort` protocols, so it runs the
same in-process and across the network.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence

from cluster.ports import DrafterPort, VerifierPort
from cluster.request import (
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    GenerationResult,
    SpeculationStats,
)
from cluster.text import TextAssembler
from verifier.block import DraftBlock
from verifier.errors import InvalidArgumentError

Decode = Callable[[Sequence[int]], str]
"""Token ids to text, special tokens left out."""


class _Generation:
    """The state of one request inside the router."""

    def __init__(self, request: GenerationRequest, decode: Decode) -> None:
        self.request = request
        self.session_id = uuid.uuid4().hex
        self.committed = len(request.prompt_tokens)
        self.stats = SpeculationStats()
        self.text = TextAssembler(decode, request.stop)
        # What the drafter's session has: its committed length, and the tokens committed
        # since then that it has not been told about yet.
        self.drafter_base = self.committed
        self.drafter_behind: list[int] = []

    @property
    def remaining(self) -> int:
        return self.request.max_tokens - len(self.text.tokens)


class Router:
    """Drives one drafter and one verifier for each request."""

    def __init__(
        self,
        verifier: VerifierPort,
        drafter: DrafterPort | None,
        decode: Decode,
        eos_token_ids: frozenset[int],
    ) -> None:
        self._verifier = verifier
        self._drafter = drafter
        self._decode = decode
        self._eos_token_ids = eos_token_ids

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """Run a request to completion."""
        tokens: list[int] = []
        text: list[str] = []
        stats = SpeculationStats()
        finish_reason = FinishReason.LENGTH
        for chunk in self._run(request, stats):
            tokens.extend(chunk.tokens)
            text.append(chunk.text)
            if chunk.finish_reason is not None:
                finish_reason = chunk.finish_reason
        return GenerationResult(
            tokens=tuple(tokens),
            text="".join(text),
            finish_reason=finish_reason,
            num_prompt_tokens=len(request.prompt_tokens),
            stats=stats,
        )

    def stream(
        self, request: GenerationRequest, stats: SpeculationStats | None = None
    ) -> Iterator[GenerationChunk]:
        """Yield tokens as they are committed; the last chunk has the finish reason.

        `stats`, when given, is updated in place as the generation runs. Closing the iterator
        early (a cancelled client) frees the request's sessions on both replicas.
        """
        return self._run(request, stats if stats is not None else SpeculationStats())

    def _run(
        self, request: GenerationRequest, stats: SpeculationStats
    ) -> Iterator[GenerationChunk]:
        speculate = request.draft_tokens > 0
        if speculate and self._drafter is None:
            raise InvalidArgumentError("speculation requested but this router has no drafter")
        gen = _Generation(request, self._decode)
        gen.stats = stats
        prompt = request.prompt_tokens
        self._verifier.open_session(gen.session_id, prompt, request.sampling, request.seed)
        try:
            if speculate and self._drafter is not None:
                self._drafter.open_session(gen.session_id, prompt, request.sampling, request.seed)
            yield from self._loop(gen)
        finally:
            self._close(gen.session_id, speculate)

    def _loop(self, gen: _Generation) -> Iterator[GenerationChunk]:
        while True:
            block = self._draft(gen, min(gen.request.draft_tokens, gen.remaining - 1))
            verdict = self._verifier.verify(gen.session_id, block)
            gen.stats.num_verify_passes += 1
            gen.stats.num_drafted += len(block.tokens)
            gen.stats.num_accepted += verdict.num_accepted
            gen.committed = verdict.committed_length
            gen.drafter_behind.extend(verdict.tokens)

            new_tokens = list(verdict.tokens[: gen.remaining])
            finish: FinishReason | None = None
            eos_at = next((i for i, t in enumerate(new_tokens) if t in self._eos_token_ids), None)
            if eos_at is not None:
                del new_tokens[eos_at + 1 :]
                finish = FinishReason.STOP
            step = gen.text.add(new_tokens)
            text = step.text
            if step.stopped:
                finish = FinishReason.STOP
            elif finish is None and gen.remaining == 0:
                finish = FinishReason.LENGTH
            if finish is not None and not step.stopped:
                text += gen.text.finish()
            yield GenerationChunk(
                tokens=tuple(new_tokens[: step.num_tokens_kept]), text=text, finish_reason=finish
            )
            if finish is not None:
                return

    def _draft(self, gen: _Generation, num_tokens: int) -> DraftBlock:
        if num_tokens <= 0 or self._drafter is None:
            return DraftBlock(base_length=gen.committed, tokens=())
        block = self._drafter.draft(
            gen.session_id, gen.drafter_base, gen.drafter_behind, num_tokens
        )
        gen.drafter_base = block.base_length
        gen.drafter_behind = []
        return block

    def _close(self, session_id: str, speculate: bool) -> None:
        self._verifier.close_session(session_id)
        if speculate and self._drafter is not None:
            self._drafter.close_session(session_id)
