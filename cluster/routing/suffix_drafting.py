"""A request's suffix drafter, as the router uses it: asked first, the model drafter otherwise.

A suffix drafter (`drafter.suffix`, on CPU-only replicas) proposes what followed the request's
last words in text its tenant already wrote, or nothing. Each round that drafts a block now
(not one drafted ahead during a verify), the router asks it before the model drafter
(`SuffixDrafting.propose`) and verifies its block when it proposes one; otherwise the model
drafts as before. A proposal costs a network hop, so whether a round asks is priced by what
the proposals earned (`SuffixUse`): asking stops for a while after a proposal that was empty or
had nothing accepted, for 1, 2, 4 ... up to `MAX_SKIPPED_ROUNDS` rounds as such proposals
repeat, and a proposal with tokens accepted asks again the next round. On text that recurs
(an agent re-sending a file, an answer quoting its prompt) it keeps asking; on text that does
not, it costs one hop every `MAX_SKIPPED_ROUNDS` rounds.

The session is opened on the first ask with the history so far, under the request's tenant;
each later ask sends the tokens committed since the last (never a block before its verdict, so
the replica's index holds only the target's tokens). A suffix drafter that fails a call is
dropped for the rest of the request (output never depends on it); its session is closed with
the request's others. Every proposal is deterministic, so its q is one-hot and the verifier's
rule stays exact under any sampling rule.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from cluster.routing.ports import DrafterPort
from cluster.routing.request import GenerationRequest
from cluster.routing.waits import Waits, quietly
from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.errors import DeadlineExceededError, TandemError

logger = logging.getLogger(__name__)

MAX_SKIPPED_ROUNDS = 16
"""The longest pause in asking, in rounds, after proposals that earned nothing."""


@dataclass
class SuffixUse:
    """Whether a round asks the suffix drafter, from what its proposals earned. Pure."""

    fruitless: int = 0
    """Proposals in a row that were empty or had no token accepted."""
    skip: int = 0
    """Rounds left before asking again."""
    asked: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    rejected_blocks: int = 0
    """Verified blocks with a token rejected (each one failure of the per-token acceptance)."""

    @property
    def acceptance(self) -> float:
        """Per-token acceptance of its blocks: accepted tokens are successes, a block cut
        short one failure, behind a Beta(3, 1) prior (as the plan's)."""
        return (self.accepted_tokens + 3.0) / (self.accepted_tokens + self.rejected_blocks + 4.0)

    def ask(self) -> bool:
        """Whether this round asks (counting down a pause)."""
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def proposed(self, num_tokens: int) -> None:
        """A proposal came back with `num_tokens` tokens (0: nothing recurs)."""
        self.asked += 1
        self.proposed_tokens += num_tokens
        if num_tokens == 0:
            self._fruitless()

    def verified(self, num_accepted: int, num_drafted: int | None = None) -> None:
        """The verdict on a proposed block of `num_drafted` tokens accepted `num_accepted`."""
        self.accepted_tokens += num_accepted
        if num_drafted is not None and num_accepted < num_drafted:
            self.rejected_blocks += 1
        if num_accepted == 0:
            self._fruitless()
        else:
            self.fruitless = 0

    def _fruitless(self) -> None:
        self.fruitless += 1
        self.skip = min(2 ** (self.fruitless - 1), MAX_SKIPPED_ROUNDS)


@dataclass
class SuffixDrafting:
    """One request's suffix drafter: its port, its session and whether to ask it."""

    port: DrafterPort | None
    replica_id: str
    session_id: str
    use: SuffixUse = field(default_factory=SuffixUse)
    sent: int | None = None
    """Tokens of the history the session holds; None until it is opened."""
    open_sent: bool = False
    """The open was sent (it may be in flight): closing must close the session too."""

    def propose(
        self,
        request: GenerationRequest,
        history: Sequence[int],
        num_tokens: int,
        shortest: int = 1,
    ) -> Waits[DraftBlock | None]:
        """Its block continuing `history` (the committed tokens), or None: nothing proposed,
        fewer than `shortest` tokens (the block the model would draft instead: a shorter
        proposal earns less than it, and counts as fruitless), not asked this round, or it
        failed (and is dropped)."""
        port = self.port
        if port is None or num_tokens <= 0 or not self.use.ask():
            return None
        try:
            if self.sent is None:
                self.open_sent = True
                self.sent = yield from port.open_session(
                    self.session_id,
                    tuple(history),
                    request.sampling,
                    request.seed,
                    max_new_tokens=request.max_tokens,
                    tenant=request.tenant,
                )
            sent = len(history)
            appended = history[self.sent : sent]
            block: DraftBlock = yield from port.draft(
                self.session_id, self.sent, appended, num_tokens
            )
        except DeadlineExceededError:
            raise
        except TandemError as error:
            # Output never depends on it: go on without, and close what it holds.
            logger.warning("suffix drafter %s dropped for a request: %s", self.replica_id, error)
            yield from self.close()
            return None
        self.sent = sent
        worth = len(block.tokens) >= shortest
        self.use.proposed(len(block.tokens) if worth else 0)
        return block if block.tokens and worth else None

    def close(self) -> Waits[None]:
        """Close its session, if an open was sent (a consumer that leaves while it is in flight
        still closes it: over a Frames stream the close follows the open); best effort."""
        port, self.port = self.port, None
        if port is None or not self.open_sent:
            return
        yield from quietly(port.close_session(self.session_id))
