"""One request's state inside the router: what is committed, where its sessions are, and
what the drafter's session holds as far as the router knows.

Plain data and bookkeeping, no I/O: `cluster.routing.router` drives it. `history` is the single
source of truth of the request's tokens (docs/architecture.md): the replicas' sessions are caches
of it, which is why a failed replica can be replaced by a spare opened on `history`.

A round's bookkeeping costs O(tokens it commits), never O(tokens so far): `history` only grows
(`commit`), and what reads it each round (prompt lookup, the output's text) keeps its own
incremental state rather than copying or re-reading it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from llguidance import LLTokenizer

from cluster.routing.draft_length import DraftLength
from cluster.routing.draft_length_config import DraftLengthConfig
from cluster.routing.ports import DrafterPort, Pinned
from cluster.routing.request import GenerationRequest, SpeculationStats
from cluster.routing.suffix_drafting import SuffixDrafting
from cluster.routing.text import TextAssembler
from cluster.routing.waits import Started, Steps
from cluster.runtime.constraint import Constraint, TokenMatcher, tokenizer_size
from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.errors import DeadlineExceededError, InvalidArgumentError
from drafter.config import NgramConfig
from drafter.ngram import PromptLookup

Decode = Callable[[Sequence[int]], str]
"""Token ids to text, special tokens left out."""


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
class Draft:
    """A proposed block and where it came from."""

    block: DraftBlock
    by_drafter: bool
    """False for a looked-up or suffix block: the drafter's session never saw it."""
    by_suffix: bool = False
    """Proposed by the suffix drafter (`cluster.routing.suffix_drafting`)."""


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
    ) -> None:
        """`clock`: what `request.deadline` is an instant of; `ngram`: prompt lookup's settings
        (None: no lookup); `constraint`: what the generated tokens must follow (its sessions
        get it), and `grammar_tokenizer` the tokenizer prompt lookup's drafts are checked with
        against its grammar (None: no lookup under a grammar)."""
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
        self.drafter_port = pinned.drafter
        self.drafter_id = pinned.drafter_id
        self.failed: set[str] = set()
        """Replicas that failed this request: never pinned to it again."""
        self.full: set[str] = set()
        """Verifiers that had no room for this request: not tried again for room, but one may
        take it back when another fails it (it is then admitted as resumed)."""
        self.releases = releases
        """Pool releases to call when the request ends: the first pin's, then each spare's."""
        self.pipelined = pipelined
        self.session_id = uuid.uuid4().hex
        self.stats = stats
        self.text = TextAssembler(decode, request.stop, min_tokens=request.min_tokens)
        self.lengths = DraftLength(draft_length, request.draft_tokens, pipelined)
        self.history = list(request.prompt_tokens)
        """Every committed token: what prompt lookup searches. Only `commit` changes it."""
        self.lookup = PromptLookup(ngram) if ngram is not None else None
        """Prompt lookup's index over `history`."""
        self.drafter = DrafterView(base_length=len(self.history))
        asks_suffix = constraint is None and request.suffix_index
        self.suffix = SuffixDrafting(
            pinned.suffix if asks_suffix else None, pinned.suffix_id, self.session_id
        )
        """The suffix drafter, asked before the drafter (none for a constrained request: its
        blocks would have to follow the grammar, which it does not track; none where the
        tenant keeps its text out of the suffix index)."""
        self.drafter_opening: Started | None = None
        """The drafter's session being opened in the background; None once known open."""
        self.open_drafter: Callable[[], Started] | None = None
        """Opens the drafter's session when first needed (`ready_drafter`); None: it is open
        or opening already. Set while the gate holds the target alone at the request's start:
        until then, the session does not exist and nothing closes it."""
        self.opening_round = False
        """The coming round is the first and does not wait for the drafter."""

    def check_deadline(self) -> None:
        """Raise `DeadlineExceededError` once the request's deadline has passed."""
        deadline = self.request.deadline
        if deadline is not None and self._clock() >= deadline:
            raise DeadlineExceededError(
                f"the request's deadline passed after {self.text.num_tokens} of its "
                f"{self.request.max_tokens} tokens"
            )

    def ready_drafter(self) -> Steps[DrafterPort]:
        """Steps returning the drafter once its session is open (opening it first if that was
        deferred; waiting for it; raising what opening raised)."""
        assert self.drafter_port is not None
        if self.open_drafter is not None:
            self.drafter_opening, self.open_drafter = self.open_drafter(), None
        if self.drafter_opening is not None:
            yield from self.drafter_opening.finish()
            self.drafter_opening = None
        return self.drafter_port

    def commit(self, tokens: Sequence[int]) -> None:
        """Append verified tokens to `history`."""
        self.history.extend(tokens)

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
    def remaining(self) -> int:
        return self.request.max_tokens - self.text.num_tokens
