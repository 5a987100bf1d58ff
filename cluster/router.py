"""The router: owns a request's committed tokens and runs the draft/verify loop.

The router is the single source of truth for a request's token history (DESIGN.md): replicas
hold only caches of it. Per round it asks the drafter for a block of `k` tokens based on the
committed length, sends the block to the verifier, commits the verdict's tokens, and streams
them. `k` never exceeds what is left of `max_tokens` minus the one token a verify pass may add
itself, so no verified work is thrown away at the end. With `draft_tokens = 0` the drafter is
never called: each round verifies an empty block, which is plain target decoding through the
same path.

Pipelining (DESIGN.md): while the verifier checks block i, the drafter already drafts block
i+1 as if all of block i were accepted. The verify call asks the verifier to defer its bonus
token in that case, so block i+1 continues exactly the committed sequence and is sent at once
(a pipeline hit); its first token is checked against the kept target distribution. If the
verdict rejected part of block i, block i+1 is discarded (a miss) and the drafter's next call
truncates the rejected tail before appending the correction.

Adaptive draft length (optional, `draft_length`): each request's block length, and whether the
round is pipelined, are re-chosen every pass, up to its draft_tokens, from its observed
acceptance and the measured draft and verify times (`cluster.draft_length`); it falls to serial
rounds when drafts ahead would mostly be wasted, and to 0, the target alone, when speculation
does not pay.

The first token comes from the target alone: the drafter reads the prompt in the background
while the verifier does, and the opening round verifies what prompt lookup proposes (often
nothing) without waiting for it. Time to first token is then the target's own, not a prefill
on each side plus a whole speculative round.

Prompt lookup (optional, `ngram`): the router holds the whole token history, so before asking
the drafter for a block it looks for the history's last few tokens earlier in the history and,
when they recur, proposes what followed them (`drafter.ngram`): no model, no network hop. The
drafter model drafts only when lookup finds nothing. A looked-up block never reaches the
drafter, so the drafter's view simply gains its committed tokens like any others.

The router depends only on the `DrafterPort` and `VerifierPort` protocols, so it runs the
same in-process and across the network.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from cluster.draft_length import DraftLength, DraftLengthConfig
from cluster.ports import DrafterPort, FixedReplicas, Pinned, ReplicaPool, VerifierPort
from cluster.request import (
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    GenerationResult,
    SpeculationStats,
)
from cluster.text import TextAssembler
from drafter.ngram import NgramConfig, propose
from verifier.block import DraftBlock, Verdict

Decode = Callable[[Sequence[int]], str]
"""Token ids to text, special tokens left out."""

MAX_CONCURRENT_DRAFTS = 64
"""Drafts running ahead at once, across all requests of one router."""


@dataclass
class DrafterView:
    """What the drafter's session holds, as far as the router knows, and what it must be told
    before its next draft."""

    base_length: int
    """The drafter session's committed length."""
    truncate_to: int | None = None
    """Drop the session's tokens from here on first (a rejected block it assumed accepted)."""
    behind: list[int] = field(default_factory=list)
    """Tokens committed since, not yet sent to the drafter."""


@dataclass(frozen=True)
class _Draft:
    """A proposed block and where it came from."""

    block: DraftBlock
    by_drafter: bool
    """False for a looked-up block: the drafter's session never saw it."""


class _Generation:
    """The state of one request inside the router."""

    def __init__(
        self,
        request: GenerationRequest,
        decode: Decode,
        stats: SpeculationStats,
        pinned: Pinned,
        pipelined: bool,
        draft_length: DraftLengthConfig,
    ) -> None:
        self.request = request
        self.verifier = pinned.verifier
        self.drafter_port = pinned.drafter
        self.pipelined = pipelined
        self.session_id = uuid.uuid4().hex
        self.stats = stats
        self.text = TextAssembler(decode, request.stop)
        self.lengths = DraftLength(draft_length, request.draft_tokens, pipelined)
        self.history = list(request.prompt_tokens)
        """Every committed token: what prompt lookup searches."""
        self.drafter = DrafterView(base_length=len(self.history))
        self.drafter_opening: Future[int] | None = None
        """The drafter's session being opened in the background; None once known open."""
        self.opening_round = False
        """The coming round is the first and does not wait for the drafter."""

    def ready_drafter(self) -> DrafterPort:
        """The drafter, once its session is open (waits for it; raises what opening raised)."""
        assert self.drafter_port is not None
        if self.drafter_opening is not None:
            self.drafter_opening.result()
            self.drafter_opening = None
        return self.drafter_port

    @property
    def committed(self) -> int:
        return len(self.history)

    @property
    def remaining(self) -> int:
        return self.request.max_tokens - len(self.text.tokens)


class Router:
    """Drives a drafter and a verifier for each request; safe to share between threads."""

    def __init__(
        self,
        verifier: VerifierPort,
        drafter: DrafterPort | None,
        decode: Decode,
        eos_token_ids: frozenset[int],
        pipelined: bool = True,
        ngram: NgramConfig | None = None,
        draft_length: DraftLengthConfig | None = None,
    ) -> None:
        """A router over one fixed verifier and drafter (the in-process transport)."""
        replicas = FixedReplicas(verifier, drafter)
        self._init(replicas, decode, eos_token_ids, pipelined, ngram, draft_length)

    @classmethod
    def over_pool(
        cls,
        replicas: ReplicaPool,
        decode: Decode,
        eos_token_ids: frozenset[int],
        pipelined: bool = True,
        ngram: NgramConfig | None = None,
        draft_length: DraftLengthConfig | None = None,
    ) -> Router:
        """A router that pins each request to replicas chosen by `replicas` (distributed)."""
        router = cls.__new__(cls)
        router._init(replicas, decode, eos_token_ids, pipelined, ngram, draft_length)
        return router

    def _init(
        self,
        replicas: ReplicaPool,
        decode: Decode,
        eos_token_ids: frozenset[int],
        pipelined: bool,
        ngram: NgramConfig | None,
        draft_length: DraftLengthConfig | None,
    ) -> None:
        self._replicas = replicas
        self._decode = decode
        self._eos_token_ids = eos_token_ids
        self.pipelined = pipelined
        self.ngram = ngram if ngram is not None and ngram.enabled else None
        """Prompt lookup settings; None: every block comes from the drafter."""
        self.draft_length = draft_length or DraftLengthConfig()
        self.first_token_alone = True
        """The opening round verifies only what prompt lookup proposes while the drafter reads
        the prompt; False: it waits for the drafter (tests of the first tokens' sampling)."""
        self._pool = ThreadPoolExecutor(MAX_CONCURRENT_DRAFTS, thread_name_prefix="draft-ahead")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def generate(
        self, request: GenerationRequest, pipelined: bool | None = None
    ) -> GenerationResult:
        """Run a request to completion."""
        tokens: list[int] = []
        text: list[str] = []
        stats = SpeculationStats()
        finish_reason = FinishReason.LENGTH
        for chunk in self._run(request, stats, pipelined):
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
        self,
        request: GenerationRequest,
        stats: SpeculationStats | None = None,
        pipelined: bool | None = None,
    ) -> Generator[GenerationChunk, None, None]:
        """Yield tokens as they are committed; the last chunk has the finish reason.

        `stats`, when given, is updated in place as the generation runs. `pipelined` overrides
        the router's default for this request. Closing the iterator early (a cancelled client)
        frees the request's sessions on both replicas.
        """
        return self._run(request, stats if stats is not None else SpeculationStats(), pipelined)

    def _run(
        self, request: GenerationRequest, stats: SpeculationStats, pipelined: bool | None
    ) -> Generator[GenerationChunk, None, None]:
        speculate = request.draft_tokens > 0
        pinned = self._replicas.pin(speculate)
        try:
            # With no drafter available the request runs on the target alone: lossless.
            use_pipeline = self.pipelined if pipelined is None else pipelined
            gen = _Generation(request, self._decode, stats, pinned, use_pipeline, self.draft_length)
            yield from self._session(gen)
        finally:
            pinned.release()

    def _session(self, gen: _Generation) -> Iterator[GenerationChunk]:
        request = gen.request
        prompt = request.prompt_tokens
        port = gen.drafter_port
        gen.opening_round = self.first_token_alone
        if port is not None:
            gen.drafter_opening = self._pool.submit(
                port.open_session, gen.session_id, prompt, request.sampling, request.seed
            )
        try:
            gen.verifier.open_session(gen.session_id, prompt, request.sampling, request.seed)
        except BaseException:
            self._close_drafter(gen)
            raise
        try:
            yield from self._loop(gen)
        finally:
            gen.verifier.close_session(gen.session_id)
            self._close_drafter(gen)

    def _loop(self, gen: _Generation) -> Iterator[GenerationChunk]:
        draft: _Draft | None = None  # a block drafted ahead that is still valid
        ahead: Future[_Draft] | None = None
        try:
            while True:
                remaining = gen.remaining
                plan = gen.lengths.next_plan()
                opening = gen.opening_round
                gen.opening_round = False
                if draft is None:
                    draft = self._draft_now(gen, min(plan.k, remaining - 1), by_drafter=not opening)
                block = draft.block
                # If all of `block` is accepted (bonus deferred), `remaining - k` tokens are
                # left and the next block must leave room for one more of the target's own.
                next_k = min(plan.k, remaining - len(block.tokens) - 1)
                if plan.pipelined and not opening and len(block.tokens) > 0 and next_k > 0:
                    ahead = self._draft_ahead(gen, block, next_k)
                # A looked-up block ahead is ready at once: the verify pass then runs alone.
                overlapped = ahead is not None and not ahead.done()
                started = time.perf_counter()
                verdict = gen.verifier.verify(gen.session_id, block, defer_bonus=ahead is not None)
                if not opening:  # the opening pass runs beside the drafter's prefill
                    gen.lengths.observe_verify(time.perf_counter() - started, overlapped)
                gen.lengths.observe(len(block.tokens), verdict.num_accepted)
                next_draft = ahead.result() if ahead is not None else None
                ahead = None
                gen.history.extend(verdict.tokens)
                assert gen.committed == verdict.committed_length, "verifier and router disagree"
                self._count(gen.stats, block, verdict, next_draft)
                draft = self._after_verdict(gen, block, verdict, next_draft)

                chunk = self._emit(gen, verdict)
                yield chunk
                if chunk.finish_reason is not None:
                    return
        finally:
            if ahead is not None:
                # Let a draft in flight finish before the sessions are closed under it.
                ahead.exception()

    def _look_up(self, history: Sequence[int], num_tokens: int) -> DraftBlock | None:
        if self.ngram is None:
            return None
        tokens = propose(history, num_tokens, self.ngram)
        return DraftBlock(base_length=len(history), tokens=tokens) if tokens else None

    def _draft_now(self, gen: _Generation, num_tokens: int, by_drafter: bool = True) -> _Draft:
        """A block to verify now: looked up, else drafted (if `by_drafter`), else empty."""
        if num_tokens <= 0:
            return _Draft(DraftBlock(base_length=gen.committed, tokens=()), by_drafter=False)
        looked_up = self._look_up(gen.history, num_tokens)
        if looked_up is not None or gen.drafter_port is None or not by_drafter:
            empty = DraftBlock(base_length=gen.committed, tokens=())
            return _Draft(looked_up or empty, by_drafter=False)
        view = gen.drafter
        port = gen.ready_drafter()
        started = time.perf_counter()
        block = port.draft(
            gen.session_id, view.base_length, view.behind, num_tokens, view.truncate_to
        )
        gen.lengths.observe_draft(len(block.tokens), time.perf_counter() - started)
        gen.drafter = DrafterView(base_length=block.base_length)
        return _Draft(block, by_drafter=True)

    def _draft_ahead(
        self, gen: _Generation, block: DraftBlock, num_tokens: int
    ) -> Future[_Draft] | None:
        """Propose the block after `block` as if all of it were accepted: looked up at once,
        or drafted in the background; None if neither can."""
        looked_up = self._look_up(gen.history + list(block.tokens), num_tokens)
        if looked_up is not None:
            done: Future[_Draft] = Future()
            done.set_result(_Draft(looked_up, by_drafter=False))
            return done
        if gen.drafter_port is None:
            return None
        port = gen.ready_drafter()
        # The drafter catches up on what its view lacks, then on `block` itself (a no-op
        # suffix when `block` came from it: its view then lacks nothing).
        view = gen.drafter
        appended = view.behind + list(block.tokens)

        def draft() -> _Draft:
            started = time.perf_counter()
            next_block = port.draft(
                gen.session_id, view.base_length, appended, num_tokens, view.truncate_to
            )
            elapsed = time.perf_counter() - started
            gen.lengths.observe_draft(len(next_block.tokens), elapsed, overlapped=True)
            return _Draft(next_block, by_drafter=True)

        return self._pool.submit(draft)

    @staticmethod
    def _after_verdict(
        gen: _Generation, block: DraftBlock, verdict: Verdict, next_draft: _Draft | None
    ) -> _Draft | None:
        """Update the drafter's view; return the draft to verify next, if one is ready."""
        hit = next_draft is not None and verdict.bonus_deferred
        if next_draft is None or not next_draft.by_drafter:
            gen.drafter.behind.extend(verdict.tokens)
            return next_draft if hit else None
        next_base = next_draft.block.base_length
        if hit:
            gen.drafter = DrafterView(base_length=next_base)
            return next_draft
        # The drafter assumed all of `block`: keep what was accepted, then the correction.
        gen.drafter = DrafterView(
            base_length=next_base,
            truncate_to=block.base_length + verdict.num_accepted,
            behind=list(verdict.tokens[verdict.num_accepted :]),
        )
        return None

    @staticmethod
    def _count(
        stats: SpeculationStats, block: DraftBlock, verdict: Verdict, next_draft: _Draft | None
    ) -> None:
        stats.num_verify_passes += 1
        stats.num_drafted += len(block.tokens)
        stats.num_accepted += verdict.num_accepted
        stats.record_block(len(block.tokens), verdict.num_accepted)
        if next_draft is not None:
            if verdict.bonus_deferred:
                stats.pipeline_hits += 1
            else:
                stats.pipeline_misses += 1

    def _emit(self, gen: _Generation, verdict: Verdict) -> GenerationChunk:
        """Commit the verdict's tokens to the output, applying end-of-sequence and stops."""
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
        return GenerationChunk(
            tokens=tuple(new_tokens[: step.num_tokens_kept]), text=text, finish_reason=finish
        )

    @staticmethod
    def _close_drafter(gen: _Generation) -> None:
        """Close the drafter's session, once it has opened (if opening failed, nothing is)."""
        if gen.drafter_port is None:
            return
        if gen.drafter_opening is not None and gen.drafter_opening.exception() is not None:
            return
        gen.drafter_port.close_session(gen.session_id)
