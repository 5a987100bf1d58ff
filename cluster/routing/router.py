"""The router: owns a request's committed tokens and runs its loop over a drafter and a verifier.

Contract:
- The router is the single source of truth for a request's token history; replicas hold only
  caches of it. It pins each request to a verifier and a drafter, opens a session on each and
  runs the request's loop (`cluster.routing.rounds`): the verifier's session advances on its
  own in every verifier step and reports each one; the router commits, streams, and posts draft
  blocks while speculation pays, beside the device's steps, never between them.
- No block needs more context than the prompt plus `max_tokens`. With `draft_tokens = 0` the
  drafter is never called: plain target decoding through the same path.
- Speculation: the suffix drafter, prompt lookup (`cluster.routing.prompt_lookup`) or the
  draft model proposes; the adaptive plan (`cluster.routing.draft_length`) sets length,
  pipelining and pre-drafting; the gate (`cluster.routing.speculation_gate`) holds the target
  alone where speculating does not pay.
- Failover (`cluster.routing.failover`): a failed replica's request moves to a spare on its
  whole history, or goes on with the target alone when a drafter has none.
- Deadlines: checked before the sessions open and whenever the loop wakes; past it,
  `DeadlineExceededError` ends the request and closes its sessions; replicas are told the time
  left. A deadline never fails over.
- Audit: `reference` replays a finished request through the plain target on a pooled verifier.
- It depends only on the `DrafterPort` and `VerifierPort` protocols: the same in-process and
  across the network.

The design, with the reasons: docs/architecture.md, "The verifier drives each session" and, under
"Mechanisms", "Pipelining", "Adaptive plan", "Failover" and "Deadlines".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import TYPE_CHECKING, TypedDict, Unpack

from llguidance import LLTokenizer

from cluster.metrics.recorder import TandemMetrics
from cluster.routing.draft_calls import DraftCalls
from cluster.routing.draft_length_config import DraftLengthConfig
from cluster.routing.draft_modes import MODEL
from cluster.routing.failover import Failover
from cluster.routing.generation import Decode, Generation
from cluster.routing.output import decode_for
from cluster.routing.ports import (
    DrafterPort,
    FixedReplicas,
    ReplicaPool,
    VerifierPort,
    closed_quietly,
)
from cluster.routing.request import (
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    GenerationResult,
    SpeculationStats,
)
from cluster.routing.rounds import Rounds
from cluster.routing.speculation_gate import GateConfig, SpeculationGate
from cluster.routing.waits import Wait, Waits, blocking, finishing, run
from cluster.runtime.advance import Advance
from cluster.runtime.errors import DeadlineExceededError
from drafter.config import NgramConfig

if TYPE_CHECKING:
    from cluster.runtime.audit import Replay


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
    verifier_advances: bool
    """The verifier's sessions run (advance on their own, in every step); False: each advances
    only by the blocks the router posts, one round at a time (an empty block for the target's
    own token), the first round waiting for the drafter (tests of how drafted tokens decide
    the first tokens)."""


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
        verifier_advances: bool = True,
    ) -> None:
        """The one construction path; its keywords are the `RouterOptions` and their defaults."""
        self.verifier_advances = verifier_advances
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
        gate = SpeculationGate(GateConfig(enabled=gated), self._clock)
        predraft_gate = SpeculationGate(GateConfig(enabled=gated), self._clock)
        # Lambdas, not bound methods: `metrics` may be replaced after construction.
        self._failover = Failover(replicas, lambda cause: self.metrics.drafter_degraded(cause))
        self._rounds = Rounds(
            gate,
            predraft_gate,
            DraftCalls(self._failover, lambda: self.metrics),
            self._failover,
            lambda: self.metrics,
            eos_token_ids,
        )

    @property
    def gate(self) -> SpeculationGate:
        """Whether speculation pays for all this router's requests at once, measured."""
        return self._rounds.gate

    @property
    def predraft_gate(self) -> SpeculationGate:
        """Whether pre-drafting pays for all this router's requests that may pre-draft, against
        the same requests' rounds without it, measured the same way."""
        return self._rounds.predraft_gate

    def close(self) -> None:
        """Nothing of its own runs once its requests have ended (kept for callers that close
        what they build)."""

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
        (`stream_waits` does not).
        """
        return blocking(self.stream_waits(request, stats, pipelined))

    def stream_waits(
        self,
        request: GenerationRequest,
        stats: SpeculationStats | None = None,
        pipelined: bool | None = None,
    ) -> Generator[GenerationChunk | Wait, None, None]:
        """`stream` as waits (`cluster.routing.waits`): the chunks, with a `Wait` wherever the
        request waits for a replica, so that one driver runs any number of requests."""
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
                advance=self._advance(request),
            )
            recent = self._rounds.recent
            if recent is not None:  # price the first rounds with today's load
                gen.lengths.inherit(recent.lengths)
            gen.lengths.max_fan_out = self._max_fan_out(gen)
            if gen.lengths.max_fan_out > 0:
                self.predraft_gate.request_started()
                releases.append(self.predraft_gate.request_ended)
            yield from self._session(gen)
        finally:
            for release in releases:
                release()

    def _advance(self, request: GenerationRequest) -> Advance | None:
        """Where the request's verifier session stops advancing on its own: its end tokens
        (as `cluster.routing.output.end_at` counts them) and `max_tokens`; None when sessions
        do not run."""
        if not self.verifier_advances:
            return None
        eos = frozenset() if request.ignore_eos else self._eos_token_ids
        prompt = len(request.prompt_tokens)
        return Advance(
            max_length=prompt + request.max_tokens,
            end_token_ids=eos | frozenset(request.stop_token_ids),
            ends_from=prompt + request.min_tokens,
        )

    def _session(self, gen: Generation) -> Iterator[GenerationChunk | Wait]:
        request = gen.request
        prompt = request.prompt_tokens
        gen.check_deadline()
        if gen.drafter.port is not None:
            # The drafter reads the prompt in the background; while the gate holds the target
            # alone, only once a round may speculate (on the prompt: the committed tokens then
            # reach it as the view's catch-up, as after any round without it).
            max_new_tokens = gen.remaining  # as at the start, however late it opens
            gen.drafter.open(
                lambda port: port.open_session(
                    gen.session_id,
                    prompt,
                    request.sampling,
                    request.seed,
                    max_new_tokens=max_new_tokens,
                    constraint=gen.constraint,
                ),
                # Nothing asks the draft model yet: its prefill would only take the cores.
                deferred=self.gate.holds_target() or gen.modes.mode != MODEL,
            )
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
            yield from finishing(gen.drafter.close())
            raise
        closing = self._close_sessions(gen)
        try:
            yield from self._rounds.run(gen)
        except GeneratorExit:  # the consumer left: no more waits may be yielded
            run(closing)
            raise
        except BaseException:
            yield from finishing(closing)
            raise
        yield from finishing(closing)

    def _close_sessions(self, gen: Generation) -> Waits[None]:
        """Close the request's sessions on both sides, best effort."""
        gen.events.close()
        yield from closed_quietly("verifier", gen.verifier, gen.session_id)
        yield from gen.drafter.close()
        yield from gen.suffix.close()

    def _max_fan_out(self, gen: Generation) -> int:
        """The widest fan-out `gen` may pre-draft: the request's, else the router's; 0 where
        its drafter cannot, or it is constrained (a structured output's drafts are masked
        step by step, which branches do not follow): the plan then never prices one."""
        asked = gen.request.predraft_fan_out
        port = gen.drafter.port
        if port is None or not hasattr(port, "predraft") or gen.constraint is not None:
            return 0
        return self.predraft_fan_out if asked is None else asked
