"""One request's state inside the router: what is committed, where its sessions are (its
drafter's, with what that session holds as far as the router knows, in its `DrafterLink`:
`cluster.routing.drafter_link`), and its rounds' drafts, posts and plan.

Plain data and bookkeeping, no I/O: `cluster.routing.router` drives it. `history` is the single
source of truth of the request's tokens (docs/architecture.md): the replicas' sessions are caches
of it, which is why a failed replica can be replaced by a spare opened on `history`.

A round's bookkeeping costs O(tokens it commits), never O(tokens so far): `history` only grows
(`commit`), and what reads it each round (prompt lookup, the output's text) keeps its own
incremental state rather than copying or re-reading it.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from llguidance import LLTokenizer

from cluster.routing.draft_length import DraftLength
from cluster.routing.draft_length_config import DraftLengthConfig
from cluster.routing.draft_modes import ALONE, MODEL, DraftModes, ModesConfig
from cluster.routing.drafter_link import DrafterLink
from cluster.routing.goodput import Plan, model_pays
from cluster.routing.ports import Pinned, StepCosts
from cluster.routing.prompt_lookup import PromptLookup
from cluster.routing.request import GenerationRequest, SpeculationStats
from cluster.routing.session_events import SessionEvents
from cluster.routing.suffix_drafting import SuffixDrafting
from cluster.routing.text import TextAssembler
from cluster.routing.waits import Pending
from cluster.runtime.advance import Advance
from cluster.runtime.constraint import Constraint, TokenMatcher, tokenizer_size
from cluster.runtime.draft_block import DraftBlock, Verdict
from cluster.runtime.errors import DeadlineExceededError, InvalidArgumentError
from drafter.config import NgramConfig

Decode = Callable[[Sequence[int]], str]
"""Token ids to text, special tokens left out."""


@dataclass(frozen=True)
class Posted:
    """A block sent to the verifier whose verdict has not come."""

    block: DraftBlock
    """As sent: its base, assumed and own tokens."""
    draft: Draft
    sent_at: float
    """`time.perf_counter()` when sent."""
    deferred: bool
    """Its bonus token was asked to be deferred (a block is drafted ahead of it)."""


@dataclass(frozen=True)
class Draft:
    """A proposed block and where it came from."""

    block: DraftBlock
    by_drafter: bool
    """False for a looked-up or suffix block: the drafter's session never saw it."""
    by_suffix: bool = False
    """Proposed by the suffix drafter (`cluster.routing.suffix_drafting`)."""
    ahead: bool = False
    """Drafted (or looked up) ahead of a posted block, as if all of it were accepted
    (pipelining): verified, a pipeline hit; dropped, a miss."""


def starting_modes(config: DraftLengthConfig, max_k: int, costs: StepCosts | None) -> DraftModes:
    """A request's modes as the replicas' start-up measurement (`costs`) sets them: the draft
    model starts off where, at the plan's prior acceptance, no block length pays with the
    drafter's and the verifier's measured steps. Off without the adaptive plan."""
    modes_config = ModesConfig(enabled=config.enabled and config.measured_modes)
    if not modes_config.enabled or costs is None or max_k <= 0:
        return DraftModes(modes_config)
    prior = config.prior_accepted / (config.prior_accepted + config.prior_rejected)
    pays = model_pays(prior, max_k, costs.draft_step_s, costs.verify_s)
    modes = DraftModes(modes_config, model_pays=pays, draft_ratio=costs.draft_ratio)
    modes.seed_alone(costs.verify_s(0))
    return modes


def runs_in_lockstep(costs: StepCosts | None, modes: DraftModes, speculates: bool) -> bool:
    """Whether a request's verifier session should not run (advance on its own) but wait for
    each round's block: where it `speculates`, and its draft model starts on and shares the
    verifier's cores (a request of the target alone keeps its session running). There
    a step the verifier takes alone, while the draft model drafts the block it would verify,
    slows that draft and commits the tokens the block was for; on the qwen-coder pair on 2
    cores (AVX-512 host) the draft model's blocks were then mostly stale and the request ran at
    0.94x the target alone, against 1.41x in lockstep (docs/models.md, "The host decides")."""
    return speculates and costs is not None and costs.shared_cores and modes.mode == MODEL


class Generation:
    """The state of one request inside the router."""

    def __init__(
        self,
        request: GenerationRequest,
        decode: Decode,
        stats: SpeculationStats,
        pinned: Pinned,
        pipelined: bool,
        draft_length: DraftLengthConfig,
        releases: list[Callable[[], None]],
        clock: Callable[[], float] = time.monotonic,
        ngram: NgramConfig | None = None,
        *,
        constraint: Constraint | None = None,
        grammar_tokenizer: Callable[[], LLTokenizer] | None = None,
        advance: Advance | None = None,
    ) -> None:
        """`clock`: what `request.deadline` is an instant of; `ngram`: prompt lookup's settings
        (None: no lookup); `advance`: where its session would stop running, kept unless it runs
        in lockstep (`runs_in_lockstep`); `constraint`: what the generated tokens must follow
        (its sessions get it), and `grammar_tokenizer` the tokenizer prompt lookup's drafts are
        checked with against its grammar (None: no lookup under a grammar)."""
        self.request = request
        self.constraint = constraint
        self.lookup_matcher: TokenMatcher | None = None
        """Where prompt lookup's drafts are cut: the first token the constraint forbids."""
        if constraint is not None and ngram is not None:
            if constraint.grammar is None:
                self.lookup_matcher = TokenMatcher(constraint, None, tokenizer_size(None))
            elif grammar_tokenizer is None:
                ngram = None
            else:
                tokenizer = grammar_tokenizer()
                self.lookup_matcher = TokenMatcher(constraint, tokenizer, tokenizer.vocab_size)
        self._clock = clock
        self.verifier = pinned.verifier
        self.verifier_id = pinned.verifier_id
        self.failed: set[str] = set()
        """Replicas that failed this request: never pinned to it again."""
        self.full: set[str] = set()
        """Verifiers that had no room for this request: not tried again for room, but one may
        take it back when another fails it (it is then admitted as resumed)."""
        self.releases = releases
        """Pool releases to call when the request ends: the first pin's, then each spare's."""
        self.pipelined = pipelined
        self.session_id = uuid.uuid4().hex
        """The request's session id on each of its replicas."""
        self.stats = stats
        self.text = TextAssembler(decode, request.stop, min_tokens=request.min_tokens)
        self.lengths = DraftLength(draft_length, request.draft_tokens, pipelined)
        self.modes = starting_modes(draft_length, request.draft_tokens, pinned.step_costs)
        """Which drafting its own measured rate keeps (`cluster.routing.draft_modes`)."""
        lockstep = runs_in_lockstep(pinned.step_costs, self.modes, request.draft_tokens > 0)
        self.advance = None if lockstep else advance
        """Where its verifier session's output ends: the session runs (None: it advances by
        the blocks the router posts only)."""
        self.lockstep_reason = (
            "; lockstep rounds: the draft shares the target's cores"
            if lockstep and advance is not None
            else ""
        )
        """Why its session does not run where the router would run it (`runs_in_lockstep`),
        as the report of its drafting says it; empty: it runs, or the router runs none."""
        self.history = list(request.prompt_tokens)
        """Every committed token: what prompt lookup searches. Only `commit` changes it."""
        self.lookup = PromptLookup(ngram) if ngram is not None else None
        """Prompt lookup's index over `history`."""
        self.drafter = DrafterLink(
            pinned.drafter, pinned.drafter_id, self.session_id, committed=len(self.history)
        )
        """Its drafter: the replica, its session's opening and what the session holds (None
        port: none)."""
        asks_suffix = constraint is None and request.suffix_index
        self.suffix = SuffixDrafting(
            pinned.suffix if asks_suffix else None, pinned.suffix_id, self.session_id
        )
        """The suffix drafter, asked before the drafter (none for a constrained request: its
        blocks would have to follow the grammar, which it does not track; none where the
        tenant keeps its text out of the suffix index)."""
        self.events = SessionEvents()
        """What the verifier's running session reports (replaced with its session on a
        failover)."""
        self.posts: dict[int, Posted] = {}
        """Blocks posted to the verifier whose verdicts have not come, by post id."""
        self._post_ids = itertools.count(1)
        self.drafting: Pending | None = None
        """The draft call in flight (at most one), returning the `Draft` to post."""
        self.plan = Plan(0, False)
        """The plan of the block drafted last (its length, whether it pipelines)."""
        self.round_mode = ALONE
        """The mode the last round was planned in: what the stretch to the next report is
        counted to."""
        self.predrafted: Pending | None = None
        """Branches being pre-drafted for the outcomes of a posted block (`predraft_for`)."""
        self.predraft_for: int | None = None
        self.predraft_verdict: Verdict | None = None
        """The verdict on that block, once in (the branch it hits is posted next)."""
        self.heard_at = clock()
        """When the verifier last reported (its session opened, or a step)."""
        self.silent_from = self.heard_at
        """Where the verifier's present window of allowed silence began: its last report, or
        the last time its liveness found it busy (`cluster.routing.liveness`)."""
        self.liveness: Future[bool] | None = None
        """The verifier's liveness check in flight, once a window passed in silence."""
        self.liveness_until = 0.0

    def check_deadline(self) -> None:
        """Raise `DeadlineExceededError` once the request's deadline has passed."""
        deadline = self.request.deadline
        if deadline is not None and self._clock() >= deadline:
            raise DeadlineExceededError(
                f"the request's deadline passed after {self.text.num_tokens} of its "
                f"{self.request.max_tokens} tokens"
            )

    def commit(self, tokens: Sequence[int]) -> None:
        """Append verified tokens to `history`."""
        self.history.extend(tokens)

    def now(self) -> float:
        """The clock the request's deadline is an instant of."""
        return self._clock()

    def next_post_id(self) -> int:
        return next(self._post_ids)

    def restart_verifier(self) -> None:
        """Its verifier changes (a failover): nothing posted to the old one will be answered,
        and a new session's events replace its."""
        self.events.close()
        self.events = SessionEvents()
        self.posts.clear()

    def look_up(self, num_tokens: int, ahead: Sequence[int] = ()) -> DraftBlock | None:
        """The block prompt lookup proposes after `history` and then `ahead` (a block not yet
        verified), or None when lookup is off or finds nothing."""
        if self.lookup is None:
            return None
        tokens = self.lookup.propose(self.history, num_tokens, ahead)
        if tokens and self.lookup_matcher is not None:
            tokens = self._within_constraint(self.lookup_matcher, tokens, ahead)
        return (
            DraftBlock(base_length=self.committed + len(ahead), tokens=tokens) if tokens else None
        )

    def _within_constraint(
        self, matcher: TokenMatcher, tokens: tuple[int, ...], ahead: Sequence[int]
    ) -> tuple[int, ...]:
        """`tokens` cut at the first the constraint forbids after `history` and `ahead`."""
        generated = self.history[matcher.constraint.prompt_length :]
        try:
            matcher.sync([*generated, *ahead])
        except InvalidArgumentError:
            self.lookup = None  # the tokens broke it (a verifier fault): no lookup from here
            return ()
        return tokens[: matcher.allowed_prefix(tokens)]

    @property
    def committed(self) -> int:
        return len(self.history)

    @property
    def prompt_length(self) -> int:
        return len(self.request.prompt_tokens)

    @property
    def remaining(self) -> int:
        """Tokens the output may still get: `max_tokens` less those committed."""
        return self.request.max_tokens - (len(self.history) - len(self.request.prompt_tokens))
