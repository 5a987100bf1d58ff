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
while the verifier does (while the speculation gate holds the target alone, only once a round
may speculate), and the opening round verifies what prompt lookup proposes (often
nothing) without waiting for it. Time to first token is then the target's own, not a prefill
on each side plus a whole speculative round.

Prompt lookup (optional, `ngram`): the router holds the whole token history, so before asking
the drafter for a block it looks for the history's last few tokens earlier in the history and,
when they recur, proposes what followed them (`drafter.ngram`): no model, no network hop. The
drafter model drafts only when lookup finds nothing. A looked-up block never reaches the
drafter, so the drafter's view simply gains its committed tokens like any others. Each request
keeps an index of its history (`drafter.ngram.PromptLookup`), so a lookup, like the rest of a
round's bookkeeping (`cluster.routing.generation`), costs O(new tokens), not O(history).

Failover (`cluster.routing.failover`): a request whose replica fails it moves to a spare, on
its whole history, or, for a drafter with none, goes on with the target alone.

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

The calls that fetch a round's blocks (now, ahead, pre-drafted) are `cluster.routing.draft_calls`.
The router depends only on the `DrafterPort` and `VerifierPort` protocols, so it runs the
same in-process and across the network.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypedDict, Unpack

from llguidance import LLTokenizer

from cluster.metrics import TandemMetrics
from cluster.routing.draft_calls import DraftCalls
from cluster.routing.draft_length import DraftLength, Plan
from cluster.routing.draft_length_config import DraftLengthConfig
from cluster.routing.failover import DRAFTER_FAILED, Failover
from cluster.routing.generation import Decode, Draft, Generation
from cluster.routing.outcome import after_verdict, count_round
from cluster.routing.output import decode_for, emit
from cluster.routing.ports import (
    DrafterPort,
    FixedReplicas,
    ReplicaPool,
    VerifierPort,
    begin_call,
)
from cluster.routing.predrafting import predrafted
from cluster.routing.request import (
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    GenerationResult,
    SpeculationStats,
)
from cluster.routing.speculation_gate import GateConfig, SpeculationGate
from cluster.routing.waits import (
    Started,
    Steps,
    Wait,
    blocking,
    finishing,
    quietly,
    run,
)
from cluster.runtime.errors import DeadlineExceededError
from drafter.config import NgramConfig

if TYPE_CHECKING:
    from cluster.runtime.audit import Replay


MAX_CONCURRENT_DRAFTS = 64
"""Drafts running ahead at once, across all requests of one router."""


class RouterOptions(TypedDict, total=False):
    """A router's settings besides its replicas and decoding (defaults: `Router._setup`)."""

    pipelined: bool
    """Draft the next block while the verifier checks this one (a request may override it)."""
    predraft_fan_out: int
    """Pipelined rounds of greedy requests on a drafter that pre-drafts: draft the next block
    for this many likely outcomes of the verify pass instead of one (0: plain pipelining)."""
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
        *,
        suffix: DrafterPort | None = None,
        **options: Unpack[RouterOptions],
    ) -> None:
        """A router over one fixed verifier and drafter, and optionally a suffix drafter (the
        in-process transport)."""
        self._setup(FixedReplicas(verifier, drafter, suffix), decode, eos_token_ids, **options)

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
        predraft_fan_out: int = 0,
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
        self.predraft_fan_out = predraft_fan_out
        self.ngram = ngram if ngram is not None and ngram.enabled else None
        """Prompt lookup settings; None: every block comes from the drafter."""
        self.draft_length = draft_length or DraftLengthConfig()
        gated = self.draft_length.enabled and self.draft_length.speculation_gate
        self.gate = SpeculationGate(GateConfig(enabled=gated), self._clock)
        """Whether speculation pays for all this router's requests at once, measured."""
        self.predraft_gate = SpeculationGate(GateConfig(enabled=gated), self._clock)
        """Whether pre-drafting pays for all this router's requests that may pre-draft, against
        the same requests' rounds without it, measured the same way."""
        self._recent_lengths: DraftLength | None = None
        """The estimates of the request that last timed a verify pass: where a new request's
        plan starts (`DraftLength.inherit`)."""
        self.first_token_alone = True
        """The opening round verifies only what prompt lookup proposes while the drafter reads
        the prompt; False: it waits for the drafter (tests of the first tokens' sampling)."""
        self._pool = ThreadPoolExecutor(MAX_CONCURRENT_DRAFTS, thread_name_prefix="draft-ahead")
        # A lambda, not the bound method: `metrics` may be replaced after construction.
        self._failover = Failover(
            replicas, self._pool, lambda cause: self.metrics.drafter_degraded(cause)
        )
        self._drafts = DraftCalls(self._pool, self._failover, lambda: self.metrics)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._failover.close()

    def generate(
        self, request: GenerationRequest, pipelined: bool | None = None
    ) -> GenerationResult:
        """Run a request to completion."""
        tokens: list[int] = []
        text: list[str] = []
        stats = SpeculationStats()
        finish_reason = FinishReason.LENGTH
        for chunk in self.stream(request, stats, pipelined):
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
        frees the request's sessions. Blocks the consumer's thread while replicas work
        (`steps` does not).
        """
        return blocking(self.steps(request, stats, pipelined))

    def steps(
        self,
        request: GenerationRequest,
        stats: SpeculationStats | None = None,
        pipelined: bool | None = None,
    ) -> Generator[GenerationChunk | Wait, None, None]:
        """`stream` as steps (`cluster.routing.waits`): the chunks, with a `Wait` wherever the
        request waits for a replica, so that one driver runs any number of requests."""
        return self._run(request, stats if stats is not None else SpeculationStats(), pipelined)

    @property
    def waits_without_threads(self) -> bool:
        """Whether `steps` never block (every replica answers on frames), so that one event
        loop may drive any number of requests; else each must run on a thread of its own."""
        return bool(getattr(self._replicas, "waits_without_threads", False))

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
    ) -> Generator[GenerationChunk | Wait, None, None]:
        speculate = request.draft_tokens > 0
        pinned = self._replicas.pin(
            speculate,
            deadline=request.deadline,
            tenant=request.tenant,
            suffix=request.suffix_index,
        )
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
                decode_for(request, self._decode, self._decode_special),
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
            gen.lengths.max_fan_out = self._max_fan_out(gen)
            if gen.lengths.max_fan_out > 0:
                self.predraft_gate.request_started()
                releases.append(self.predraft_gate.request_ended)
            yield from self._session(gen)
        finally:
            for release in releases:
                release()

    def _session(self, gen: Generation) -> Iterator[GenerationChunk | Wait]:
        request = gen.request
        prompt = request.prompt_tokens
        port = gen.drafter_port
        gen.opening_round = self.first_token_alone
        gen.check_deadline()
        if port is not None:
            # The drafter reads the prompt in the background; while the gate holds the target
            # alone, only once a round may speculate (on the prompt: the committed tokens then
            # reach it as the view's catch-up, as after any round without it).
            max_new_tokens = gen.remaining  # as at the start, however late it opens

            def open_drafter() -> Started:
                return begin_call(
                    self._pool,
                    port,
                    "open_session",
                    gen.session_id,
                    prompt,
                    request.sampling,
                    request.seed,
                    max_new_tokens=max_new_tokens,
                    constraint=gen.constraint,
                )

            if self.gate.holds_target():
                gen.open_drafter = open_drafter
            else:
                gen.drafter_opening = open_drafter()
        try:
            # The open must end before the request does: a session the verifier opens after
            # its consumer left would stay until its TTL.
            yield from finishing(self._failover.open_verifier(gen))
        except GeneratorExit:  # the consumer left while the verifier opened: it has now
            run(self._close_sessions(gen))
            raise
        except DeadlineExceededError:  # out of time while opening, maybe after it opened
            yield from finishing(self._close_sessions(gen))
            raise
        except BaseException:
            yield from finishing(self._failover.close_drafter(gen))
            raise
        closing = self._close_sessions(gen)
        try:
            yield from self._loop(gen)
        except GeneratorExit:  # the consumer left: no more waits may be yielded
            run(closing)
            raise
        except BaseException:
            yield from finishing(closing)
            raise
        yield from finishing(closing)

    def _close_sessions(self, gen: Generation) -> Steps[None]:
        """Close the request's sessions on both sides, best effort."""
        yield from self._failover.closed_quietly("verifier", gen.verifier, gen.session_id)
        yield from self._failover.close_drafter(gen)
        yield from gen.suffix.close(self._pool)

    def _loop(self, gen: Generation) -> Iterator[GenerationChunk | Wait]:
        draft: Draft | None = None  # a block drafted ahead that is still valid
        ahead: Started | None = None
        try:
            while True:
                gen.check_deadline()
                remaining = gen.remaining
                # Where the router measured the target alone faster, the plan is not priced
                # at all (pricing costs router CPU each round).
                speculating = self.gate.speculate()
                plan = gen.lengths.next_plan() if speculating else Plan(0, False)
                if plan.fan_out > 0 and not self.predraft_gate.speculate():
                    plan = Plan(plan.k, plan.pipelined)  # measured faster without pre-drafting
                opening = gen.opening_round
                gen.opening_round = False
                if draft is None:
                    # The suffix drafter is asked even where the plan gives the model drafter no
                    # block (its own asking is priced apart), not while the gate holds the target.
                    draft = yield from self._drafts.now(
                        gen, min(plan.k, remaining - 1), by_drafter=not opening,
                        suffix=speculating and not opening,
                    )  # fmt: skip
                block = draft.block
                # If all of `block` is accepted (bonus deferred), `remaining - k` tokens are
                # left and the next block must leave room for one more of the target's own.
                next_k = min(plan.k, remaining - len(block.tokens) - 1)
                predrafting = False
                # After a suffix block the round is serial: the next asks the suffix drafter
                # again, where text that recurs goes on recurring.
                by_suffix = draft.by_suffix
                ahead_ok = not opening and not by_suffix and len(block.tokens) > 0
                if plan.pipelined and ahead_ok and next_k > 0:
                    ahead = yield from self._drafts.predraft(gen, block, next_k, plan.fan_out)
                    predrafting = ahead is not None
                    if ahead is None:
                        ahead = yield from self._drafts.ahead(gen, block, next_k)
                # A looked-up block ahead is ready at once: the verify pass then runs alone.
                overlapped = ahead is not None and not ahead.done()
                started = time.perf_counter()
                verdict = yield from self._failover.verify(
                    gen, block, defer_bonus=ahead is not None and not predrafting
                )
                if not opening:  # the opening pass runs beside the drafter's prefill
                    verify_s = time.perf_counter() - started
                    gen.lengths.observe_verify(verify_s, overlapped, verdict.load)
                    self._recent_lengths = gen.lengths
                    self.metrics.verified(verify_s)
                if by_suffix:  # priced apart: the model's acceptance is the plan's
                    gen.suffix.use.verified(verdict.num_accepted)
                    gen.stats.suffix_drafted += len(block.tokens)
                    gen.stats.suffix_accepted += verdict.num_accepted
                else:
                    gen.lengths.observe(len(block.tokens), verdict.num_accepted)
                lost: Exception | None = None
                try:
                    next_draft = (yield from ahead.finish()) if ahead is not None else None
                except DRAFTER_FAILED as error:  # the drafter failed while drafting ahead
                    next_draft, lost = None, error
                ahead = None
                gen.commit(verdict.tokens)
                if gen.request.draft_tokens > 0:
                    self.gate.committed(len(verdict.tokens))
                if gen.lengths.max_fan_out > 0:
                    self.predraft_gate.committed(len(verdict.tokens))
                assert gen.committed == verdict.committed_length, "verifier and router disagree"
                if predrafting:  # the branch the verdict hit, if any, is verified next
                    draft = predrafted(gen, block, verdict, next_draft)
                else:
                    count_round(gen.stats, block, verdict, next_draft)
                    draft = after_verdict(gen, block, verdict, next_draft)
                if lost is not None:
                    self._failover.replace(gen, "drafter", lost)

                chunk = emit(gen, verdict, self._eos_token_ids)
                yield chunk
                if chunk.finish_reason is not None:
                    return
        except GeneratorExit:
            # Let a draft in flight finish before the sessions are closed under it.
            if ahead is not None:
                run(quietly(ahead.finish()))
            raise
        except BaseException:
            if ahead is not None:
                yield from finishing(quietly(ahead.finish()))
            raise

    def _max_fan_out(self, gen: Generation) -> int:
        """The widest fan-out `gen` may pre-draft: the request's, else the router's; 0 where
        its drafter cannot, or it is constrained (a structured output's drafts are masked
        step by step, which branches do not follow): the plan then never prices one."""
        asked = gen.request.predraft_fan_out
        port = gen.drafter_port
        if port is None or not hasattr(port, "predraft") or gen.constraint is not None:
            return 0
        return self.predraft_fan_out if asked is None else asked
