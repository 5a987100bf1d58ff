"""The router: owns a request's committed tokens and runs the draft/verify loop.

The router is the single source of truth for a request's token history (docs/architecture.md):
replicas hold only caches of it. Per round it asks the drafter for a block of `k` tokens based on
the committed length, sends the block to the verifier, commits the verdict's tokens, and streams
them. `k` never exceeds what is left of `max_tokens` minus the one token a verify pass may add
itself, so no verified work is thrown away at the end, and no pass, nor a block drafted ahead,
ever needs more context than the prompt plus `max_tokens`: a request within the verifier's
context limit (the service refuses any other) never meets it. With `draft_tokens = 0` the
drafter is never called: each round verifies an empty block, which is plain target decoding
through the same path.

Pipelining (docs/architecture.md): while the verifier checks block i, the drafter already drafts
block i+1 as if all of block i were accepted. The verify call asks the verifier to defer its bonus
token in that case, so block i+1 continues exactly the committed sequence and is sent at once
(a pipeline hit); its first token is checked against the kept target distribution. If the
verdict rejected part of block i, block i+1 is discarded (a miss) and the drafter's next call
truncates the rejected tail before appending the correction.

Adaptive draft length (optional, `draft_length`): each request's block length, and whether the
round is pipelined, are re-chosen every pass, up to its draft_tokens, from its observed
acceptance and the measured draft and verify times, priced with the batch each replica reports
(`cluster.routing.draft_length`); it falls to serial rounds when drafts ahead would mostly be
wasted, and to 0, the target alone, when speculation does not pay (at high load too).

The first token comes from the target alone: the drafter reads the prompt in the background
while the verifier does, and the opening round verifies what prompt lookup proposes (often
nothing) without waiting for it. Time to first token is then the target's own, not a prefill
on each side plus a whole speculative round.

Prompt lookup (optional, `ngram`): the router holds the whole token history, so before asking
the drafter for a block it looks for the history's last few tokens earlier in the history and,
when they recur, proposes what followed them (`drafter.ngram`): no model, no network hop. The
drafter model drafts only when lookup finds nothing. A looked-up block never reaches the
drafter, so the drafter's view simply gains its committed tokens like any others. Each request
keeps an index of its history (`drafter.ngram.PromptLookup`), so a lookup, like the rest of a
round's bookkeeping (`cluster.routing.generation`), costs O(new tokens), not O(history).

Failover: replicas hold only soft state and the router holds every committed token, so when
a replica fails a call (unreachable, or it no longer knows the session) the request moves on.
A verifier is replaced by a spare of the pool, whose session is opened on the whole history
(prompt and committed tokens) before the same block is verified again; so is one that refuses
the session for lack of KV memory, at open (its planned growth does not fit: sessions are
opened planned for what is left of `max_tokens`) or mid-request; a drafter is replaced
the same way, or, with no spare, the request goes on with the target alone; so it does, with no
spare sought, when its drafter refuses at a limit of its own (RESOURCE_EXHAUSTED: a context
smaller than the verifier's, or a full session table). Greedy output is
the same as without the failure, and so is seed-exact output (its noise is keyed by position);
rejection-rule output keeps its distribution (the spare's generator starts afresh, so such a
request is no longer repeatable across the failure). At most
`MAX_FAILOVERS` per request, then the error goes to the caller.

Deadlines: a request with a `deadline` is checked against it before its sessions open and
before every round; past it, `DeadlineExceededError` ends the request and its sessions are
closed like any other's, freeing their KV caches. The pool's ports are bound to the deadline
too (over gRPC a call stops when the time runs out, and each replica is told how long the
session may live, so it drops the session itself should the router die). A deadline is the
caller's limit, not a replica failure: it never fails over.

Audit: `reference` replays a finished request through the plain target on a verifier of the
pool (`VerifierPort.reference`), for the service's audit (`cluster.api.audit`).

Metrics (`cluster.metrics`): the time of every drafter call and of every verify pass after the
opening one (the times the adaptive plan measures) go to two histograms.

The router depends only on the `DrafterPort` and `VerifierPort` protocols, so it runs the
same in-process and across the network.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, TypedDict, Unpack

from llguidance import LLTokenizer

from cluster.metrics import TandemMetrics
from cluster.routing.draft_length import DraftLength, DraftLengthConfig, Plan
from cluster.routing.generation import Decode, Draft, DrafterView, Generation
from cluster.routing.ports import DrafterPort, FixedReplicas, ReplicaPool, VerifierPort
from cluster.routing.request import (
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    GenerationResult,
    SpeculationStats,
)
from cluster.routing.speculation_gate import GateConfig, SpeculationGate
from cluster.runtime.block import DraftBlock, Verdict
from cluster.runtime.errors import (
    InvalidArgumentError,
    ReplicaUnavailableError,
    ResourceExhaustedError,
    SessionNotFoundError,
    TandemError,
)
from drafter.ngram import NgramConfig

if TYPE_CHECKING:
    from cluster.runtime.audit import Replay

logger = logging.getLogger(__name__)


MAX_CONCURRENT_DRAFTS = 64
"""Drafts running ahead at once, across all requests of one router."""
MAX_BACKGROUND_CLOSES = 4
"""Threads closing, in the background, the sessions of replicas a request failed over from."""
MAX_FAILOVERS = 4
"""Replicas one request may replace (both sides together) before it fails."""
LOST = (ReplicaUnavailableError, SessionNotFoundError)
"""What a replica raises when the request's session there is gone: fail over. Never
`DeadlineExceededError` (the request is out of time) nor `ResourceExhaustedError` (a limit)."""
VERIFIER_MOVES = (*LOST, ResourceExhaustedError)
"""What moves a request's verification to a spare verifier mid-request: LOST, or a verifier
whose KV pool cannot hold the session's growth (a spare may have room; the full one's session
is closed, freeing its blocks)."""
DRAFTER_FAILED = Exception
"""What a drafter call may raise without failing the request: LOST fails over to a spare
drafter; anything else (a limit of its own, a refusal, an internal fault) ends drafting for the
request, which goes on with the target alone (the drafter is optional). Only the request's own
deadline, checked first, ends the request."""


class RouterOptions(TypedDict, total=False):
    """A router's settings besides its replicas and decoding (defaults: `Router._setup`)."""

    pipelined: bool
    """Draft the next block while the verifier checks this one (a request may override it)."""
    ngram: NgramConfig | None
    """Prompt lookup, tried before the drafter."""
    draft_length: DraftLengthConfig | None
    """Adaptive block length."""
    clock: Callable[[], float]
    """What request deadlines are instants of."""
    metrics: TandemMetrics | None
    """Where draft and verify latencies go (default: Ray's metrics, if in a Ray worker)."""
    decode_special: Decode | None
    """Token ids to text with special tokens kept: the text of a request whose
    `skip_special_tokens` is false (None: such a request is INVALID_ARGUMENT)."""
    grammar_tokenizer: Callable[[], LLTokenizer] | None
    """llguidance's view of the target's tokenizer, for cutting prompt lookup's drafts at the
    first token a request's grammar forbids; None: no prompt lookup for such requests."""


class Router:
    """Drives a drafter and a verifier for each request; safe to share between threads."""

    def __init__(
        self,
        verifier: VerifierPort,
        drafter: DrafterPort | None,
        decode: Decode,
        eos_token_ids: frozenset[int],
        **options: Unpack[RouterOptions],
    ) -> None:
        """A router over one fixed verifier and drafter (the in-process transport)."""
        self._setup(FixedReplicas(verifier, drafter), decode, eos_token_ids, **options)

    @classmethod
    def over_pool(
        cls,
        replicas: ReplicaPool,
        decode: Decode,
        eos_token_ids: frozenset[int],
        **options: Unpack[RouterOptions],
    ) -> Router:
        """A router that pins each request to replicas chosen by `replicas` (distributed)."""
        router = cls.__new__(cls)
        router._setup(replicas, decode, eos_token_ids, **options)
        return router

    def _setup(
        self,
        replicas: ReplicaPool,
        decode: Decode,
        eos_token_ids: frozenset[int],
        *,
        pipelined: bool = True,
        ngram: NgramConfig | None = None,
        draft_length: DraftLengthConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: TandemMetrics | None = None,
        decode_special: Decode | None = None,
        grammar_tokenizer: Callable[[], LLTokenizer] | None = None,
    ) -> None:
        """The one construction path; its keywords are the `RouterOptions` and their defaults."""
        self._grammar_tokenizer = grammar_tokenizer
        self._replicas = replicas
        self._clock = clock
        self.metrics = metrics if metrics is not None else TandemMetrics()
        self._decode = decode
        self._decode_special = decode_special
        self._eos_token_ids = eos_token_ids
        self.pipelined = pipelined
        self.ngram = ngram if ngram is not None and ngram.enabled else None
        """Prompt lookup settings; None: every block comes from the drafter."""
        self.draft_length = draft_length or DraftLengthConfig()
        gated = self.draft_length.enabled and self.draft_length.speculation_gate
        self.gate = SpeculationGate(GateConfig(enabled=gated), self._clock)
        """Whether speculation pays for all this router's requests at once, measured."""
        self._recent_lengths: DraftLength | None = None
        """The estimates of the request that last timed a verify pass: where a new request's
        plan starts (`DraftLength.inherit`)."""
        self.first_token_alone = True
        """The opening round verifies only what prompt lookup proposes while the drafter reads
        the prompt; False: it waits for the drafter (tests of the first tokens' sampling)."""
        self._pool = ThreadPoolExecutor(MAX_CONCURRENT_DRAFTS, thread_name_prefix="draft-ahead")
        self._closer = ThreadPoolExecutor(MAX_BACKGROUND_CLOSES, thread_name_prefix="close-old")
        """Closes sessions left on replicas a request failed over from, off its path."""

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._closer.shutdown(wait=True)

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

    def reference(
        self,
        request: GenerationRequest,
        served_tokens: Sequence[int],
        dtype: str = "",
    ) -> Replay:
        """The plain target's replay of a finished request (`VerifierPort.reference`) on a
        verifier the pool picks as it picks a request's (the least loaded), within the
        request's deadline; no failover: an audit that fails is reported, not retried."""
        pinned = self._replicas.pin(False, deadline=request.deadline)
        try:
            return pinned.verifier.reference(
                request.prompt_tokens, served_tokens, request.sampling, request.seed, dtype
            )
        finally:
            pinned.release()

    def _run(
        self, request: GenerationRequest, stats: SpeculationStats, pipelined: bool | None
    ) -> Generator[GenerationChunk, None, None]:
        speculate = request.draft_tokens > 0
        pinned = self._replicas.pin(speculate, deadline=request.deadline)
        releases = [pinned.release]
        if pinned.drafter is not None:
            stats.drafters.append(pinned.drafter_id)
        if speculate:
            # The gate compares the modes it can switch: a request that never speculates
            # commits the same either way and is not counted.
            self.gate.request_started()
            releases.append(self.gate.request_ended)
        try:
            # With no drafter available the request runs on the target alone: lossless.
            use_pipeline = self.pipelined if pipelined is None else pipelined
            gen = Generation(
                request,
                self._decode_for(request),
                stats,
                pinned,
                use_pipeline,
                self.draft_length,
                releases,
                self._clock,
                self.ngram,
                constraint=request.constraint(self._eos_token_ids),
                grammar_tokenizer=self._grammar_tokenizer,
            )
            if self._recent_lengths is not None:  # price the first rounds with today's load
                gen.lengths.inherit(self._recent_lengths)
            yield from self._session(gen)
        finally:
            for release in releases:
                release()

    def _session(self, gen: Generation) -> Iterator[GenerationChunk]:
        request = gen.request
        prompt = request.prompt_tokens
        port = gen.drafter_port
        gen.opening_round = self.first_token_alone
        gen.check_deadline()
        if port is not None:
            gen.drafter_opening = self._pool.submit(
                port.open_session,
                gen.session_id,
                prompt,
                request.sampling,
                request.seed,
                max_new_tokens=gen.remaining,
                constraint=gen.constraint,
            )
        try:
            self._open_verifier(gen)
        except BaseException:
            self._close_drafter(gen)
            raise
        try:
            yield from self._loop(gen)
        finally:
            try:
                self._close_quietly("verifier", gen.verifier, gen.session_id)
            finally:
                self._close_drafter(gen)

    def _open_verifier(self, gen: Generation, resumed: bool = False) -> None:
        """Open the request's session on its verifier, over the whole history (the prompt at
        first; after a failover, every committed token too), planned to grow by what is left
        of `max_tokens`; fail over while that fails or the verifier has no room for it.
        `resumed`: the request already ran on another verifier (a failover), so no plan may
        refuse it: it would fail midway."""
        while True:
            request = gen.request
            try:
                gen.verifier.open_session(
                    gen.session_id,
                    gen.history,
                    request.sampling,
                    request.seed,
                    max_new_tokens=gen.remaining,
                    resumed=resumed,
                    constraint=gen.constraint,
                )
                return
            except VERIFIER_MOVES as error:
                self._replace(gen, "verifier", error)

    def _verify(self, gen: Generation, block: DraftBlock, defer_bonus: bool) -> Verdict:
        """Verify `block`; if the verifier fails, or its KV pool is full, verify it again on a
        spare (with none, the error ends the request)."""
        while True:
            try:
                return gen.verifier.verify(gen.session_id, block, defer_bonus=defer_bonus)
            except VERIFIER_MOVES as error:
                self._replace(gen, "verifier", error)
                self._open_verifier(gen, resumed=True)

    def _replace(self, gen: Generation, side: str, error: Exception) -> None:
        """Pin a spare of `side` in place of the replica that raised `error`; re-raise it when
        there is none, or this request has failed over too often. A lost drafter leaves the
        request to the target alone rather than failing it. A request out of time does not
        fail over (its replica may have dropped the session for that very reason)."""
        gen.check_deadline()
        if side == "drafter" and not isinstance(error, LOST):
            # A limit (a spare would be as full), a refusal or a fault of the drafter's own:
            # drop the drafter, go on with the target alone.
            cause = error.status.lower() if isinstance(error, TandemError) else "internal"
            logger.log(
                logging.INFO if isinstance(error, ResourceExhaustedError) else logging.WARNING,
                "request %s: drafting stops (%s): %s",
                gen.session_id,
                cause,
                error,
            )
            self.metrics.drafter_degraded(cause)
            self._close_drafter(gen)
            gen.drafter_port, gen.drafter_opening = None, None
            gen.drafter = DrafterView(base_length=gen.committed)
            return
        failed_id = gen.verifier_id if side == "verifier" else gen.drafter_id
        full = isinstance(error, ResourceExhaustedError)
        (gen.full if full else gen.failed).add(failed_id)
        logger.log(
            logging.INFO if full else logging.WARNING,
            "request %s: %s %s %s: %s",
            gen.session_id,
            side,
            failed_id,
            "had no room" if full else "failed",
            error,
        )
        failed_port = gen.verifier if side == "verifier" else gen.drafter_port
        if failed_port is not None and not isinstance(error, SessionNotFoundError):
            # It may only have been slow or cut off: free the session it may still hold now
            # rather than at its idle TTL, without holding up the request.
            self._closer.submit(self._close_quietly, side, failed_port, gen.session_id)
        spare = None
        if len(gen.failed) + len(gen.full) <= MAX_FAILOVERS:
            # A replica lost this request is never tried again; one that was full only when
            # the request looks for room again.
            excluded = gen.failed | gen.full if full else gen.failed
            spare = self._replicas.spare(side, frozenset(excluded), deadline=gen.request.deadline)
        if spare is not None:
            gen.releases.append(spare.release)
        if side == "verifier":
            if spare is None:
                raise error
            gen.verifier, gen.verifier_id = spare.port, spare.replica_id
            return
        gen.drafter_opening = None
        gen.drafter = DrafterView(base_length=gen.committed)
        if spare is None:
            gen.drafter_port = None  # on with the target alone (and prompt lookup)
            return
        gen.drafter_port, gen.drafter_id = spare.port, spare.replica_id
        gen.stats.drafters.append(spare.replica_id)
        request = gen.request
        gen.drafter_opening = self._pool.submit(
            spare.port.open_session,
            gen.session_id,
            list(gen.history),
            request.sampling,
            request.seed,
            max_new_tokens=gen.remaining,
            constraint=gen.constraint,
        )

    def _loop(self, gen: Generation) -> Iterator[GenerationChunk]:
        draft: Draft | None = None  # a block drafted ahead that is still valid
        ahead: Future[Draft] | None = None
        try:
            while True:
                gen.check_deadline()
                remaining = gen.remaining
                plan = gen.lengths.next_plan()
                if not self.gate.speculate():  # the router measured the target alone faster
                    plan = Plan(0, False)
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
                verdict = self._verify(gen, block, defer_bonus=ahead is not None)
                if not opening:  # the opening pass runs beside the drafter's prefill
                    verify_s = time.perf_counter() - started
                    gen.lengths.observe_verify(verify_s, overlapped, verdict.load)
                    self._recent_lengths = gen.lengths
                    self.metrics.verified(verify_s)
                gen.lengths.observe(len(block.tokens), verdict.num_accepted)
                lost: Exception | None = None
                try:
                    next_draft = ahead.result() if ahead is not None else None
                except DRAFTER_FAILED as error:  # the drafter failed while drafting ahead
                    next_draft, lost = None, error
                ahead = None
                gen.commit(verdict.tokens)
                if gen.request.draft_tokens > 0:
                    self.gate.committed(len(verdict.tokens))
                assert gen.committed == verdict.committed_length, "verifier and router disagree"
                self._count(gen.stats, block, verdict, next_draft)
                draft = self._after_verdict(gen, block, verdict, next_draft)
                if lost is not None:
                    self._replace(gen, "drafter", lost)

                chunk = self._emit(gen, verdict)
                yield chunk
                if chunk.finish_reason is not None:
                    return
        finally:
            if ahead is not None:
                # Let a draft in flight finish before the sessions are closed under it.
                ahead.exception()

    def _draft_now(self, gen: Generation, num_tokens: int, by_drafter: bool = True) -> Draft:
        """A block to verify now: looked up, else drafted (if `by_drafter`), else empty."""
        if num_tokens <= 0:
            return Draft(DraftBlock(base_length=gen.committed, tokens=()), by_drafter=False)
        looked_up = gen.look_up(num_tokens)
        if looked_up is not None or gen.drafter_port is None or not by_drafter:
            empty = DraftBlock(base_length=gen.committed, tokens=())
            return Draft(looked_up or empty, by_drafter=False)
        view = gen.drafter
        try:
            port = gen.ready_drafter()
            started = time.perf_counter()
            block = port.draft(
                gen.session_id, view.base_length, view.behind, num_tokens, view.truncate_to
            )
        except DRAFTER_FAILED as error:
            self._replace(gen, "drafter", error)
            return self._draft_now(gen, num_tokens, by_drafter)
        draft_s = time.perf_counter() - started
        gen.lengths.observe_draft(len(block.tokens), draft_s, load=block.load)
        self.metrics.drafted(draft_s)
        gen.drafter = DrafterView(base_length=block.base_length)
        return Draft(block, by_drafter=True)

    def _draft_ahead(
        self, gen: Generation, block: DraftBlock, num_tokens: int
    ) -> Future[Draft] | None:
        """Propose the block after `block` as if all of it were accepted: looked up at once,
        or drafted in the background; None if neither can."""
        looked_up = gen.look_up(num_tokens, ahead=block.tokens)
        if looked_up is not None:
            done: Future[Draft] = Future()
            done.set_result(Draft(looked_up, by_drafter=False))
            return done
        if gen.drafter_port is None:
            return None
        try:
            port = gen.ready_drafter()
        except DRAFTER_FAILED as error:
            self._replace(gen, "drafter", error)
            return None
        # The drafter catches up on what its view lacks, then on `block` itself (a no-op
        # suffix when `block` came from it: its view then lacks nothing).
        view = gen.drafter
        appended = view.behind + list(block.tokens)

        def draft() -> Draft:
            started = time.perf_counter()
            next_block = port.draft(
                gen.session_id, view.base_length, appended, num_tokens, view.truncate_to
            )
            elapsed = time.perf_counter() - started
            gen.lengths.observe_draft(
                len(next_block.tokens), elapsed, overlapped=True, load=next_block.load
            )
            self.metrics.drafted(elapsed)
            return Draft(next_block, by_drafter=True)

        return self._pool.submit(draft)

    @staticmethod
    def _after_verdict(
        gen: Generation, block: DraftBlock, verdict: Verdict, next_draft: Draft | None
    ) -> Draft | None:
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
        stats: SpeculationStats, block: DraftBlock, verdict: Verdict, next_draft: Draft | None
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

    def _decode_for(self, request: GenerationRequest) -> Decode:
        """The decode function of `request`'s text: special tokens left out, or kept."""
        if request.skip_special_tokens:
            return self._decode
        if self._decode_special is None:
            raise InvalidArgumentError(
                "skip_special_tokens false is not supported by this router: it has no "
                "decode function that keeps special tokens"
            )
        return self._decode_special

    def _emit(self, gen: Generation, verdict: Verdict) -> GenerationChunk:
        """Commit the verdict's tokens to the output, applying end tokens and stop strings.

        An end token (end-of-sequence unless the request ignores it, or one of its
        `stop_token_ids`) at output position `min_tokens` or later ends the output, finish
        reason stop. As in vLLM, it is the output's last token, but its text is left out (vLLM
        does not decode it), so a stop token id never shows in the text."""
        request = gen.request
        new_tokens = list(verdict.tokens[: gen.remaining])
        end_at = self._end_at(request, gen.text.num_tokens, new_tokens)
        text_tokens = new_tokens if end_at is None else new_tokens[:end_at]
        step = gen.text.add(text_tokens)
        text = step.text
        finish: FinishReason | None = None
        if step.stopped:
            finish = FinishReason.STOP
            tokens = text_tokens[: step.num_tokens_kept]
        else:
            if end_at is not None:
                finish = FinishReason.STOP
            elif gen.remaining == 0:
                finish = FinishReason.LENGTH
            tokens = new_tokens[: len(text_tokens) + (end_at is not None)]
            if finish is not None:
                text += gen.text.finish()
        return GenerationChunk(tokens=tuple(tokens), text=text, finish_reason=finish)

    def _end_at(
        self, request: GenerationRequest, num_before: int, tokens: Sequence[int]
    ) -> int | None:
        """Where in `tokens` (which follow `num_before` output tokens) the first end token that
        may end the output stands; None if none does."""
        stop_ids = frozenset(request.stop_token_ids)
        eos = frozenset() if request.ignore_eos else self._eos_token_ids
        first = max(request.min_tokens - num_before, 0)  # before it, end tokens do not end
        return next(
            (i for i in range(first, len(tokens)) if tokens[i] in eos or tokens[i] in stop_ids),
            None,
        )

    @classmethod
    def _close_drafter(cls, gen: Generation) -> None:
        """Close the drafter's session, once it has opened (if opening failed, nothing is)."""
        if gen.drafter_port is None:
            return
        if gen.drafter_opening is not None and gen.drafter_opening.exception() is not None:
            return
        cls._close_quietly("drafter", gen.drafter_port, gen.session_id)

    @staticmethod
    def _close_quietly(side: str, port: DrafterPort | VerifierPort, session_id: str) -> None:
        """Close a session, best effort: a replica that cannot be reached, is too busy to take
        the call or fails it drops the session itself after its time limit or TTL."""
        try:
            port.close_session(session_id)
        except Exception as error:
            logger.warning("could not close session %s on the %s: %s", session_id, side, error)
