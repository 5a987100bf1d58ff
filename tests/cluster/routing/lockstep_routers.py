"""Lockstep routers whose pipelined blocks reach the verifier after the block drafted ahead of
them: how the tests see the router's pipelining with the tiny in-process pair; and `Routers`,
such a router and the default one over the same replicas.

A lockstep router (`verifier_advances` off) posts one block a round and, where its plan
pipelines, drafts the next block while that one is verified, and posts it (its `assumed`
tokens the first block's) as soon as it is drafted. On a real deployment the drafter drafts
that block within the verify pass; in-process, the tiny drafter takes one step a token where
the tiny verifier verifies a whole block in one, so the verdict nearly always comes first and
the block ahead is rebased onto it (or given up) in the router: no block is ever verified
ahead (`SpeculationStats.pipeline_hits` and `pipeline_misses` stay 0).

`HeldVerifier` plays a verifier slower than its drafter: a block posted with its bonus
deferred (one the router drafts another ahead of) is held until the session's next post
arrives, then both go to the verifier in order, so that the block ahead is verified from
where its session stands (matched, or dropped); it is held at most `hold_s` (the block ahead
may never come: the router gives it up when the history parts from it). Nothing else changes:
the verifier, its sessions and the router's code are the real ones, and the hold changes when
a block is verified, never what.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Unpack

from cluster.local import InProcess, local_router, text_decoder
from cluster.routing.router import Router, RouterOptions
from cluster.routing.session_events import SessionEvents
from cluster.routing.waits import Waits
from cluster.runtime.constraint import grammar_tokenizer_of
from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.models import LoadedModel
from drafter.drafter import Drafter
from verifier.verifier import Verifier

HOLD_S = 0.05
"""The longest a block with its bonus deferred waits for the block drafted ahead of it."""


class HeldVerifier(InProcess):
    """An in-process verifier port that holds a block posted with `defer_bonus` until the
    session's next post (or `hold_s`), so that the block drafted ahead of it is queued behind
    it before its verdict is out (see the module docstring)."""

    def __init__(self, verifier: Verifier, hold_s: float = HOLD_S) -> None:
        super().__init__(verifier)
        self.hold_s = hold_s
        self._lock = threading.Lock()
        self._held: dict[str, tuple[Callable[[], None], threading.Timer]] = {}

    def post(
        self,
        session_id: str,
        block: DraftBlock,
        defer_bonus: bool,
        events: SessionEvents,
        post_id: int,
    ) -> None:
        def send() -> None:
            super(HeldVerifier, self).post(session_id, block, defer_bonus, events, post_id)

        self._release(session_id)  # the block before this one goes first
        if not defer_bonus:
            send()
            return
        timer = threading.Timer(self.hold_s, self._release, (session_id,))
        timer.daemon = True
        with self._lock:
            self._held[session_id] = (send, timer)
        timer.start()

    def _release(self, session_id: str, send_it: bool = True) -> None:
        """Send the block held for `session_id`, if any (once: by the next post or the
        timer, whichever comes first)."""
        with self._lock:
            held = self._held.pop(session_id, None)
            if held is None:
                return
            send, timer = held
            timer.cancel()
            if send_it:
                send()  # under the lock: a later post of the session cannot overtake it

    def close_session(self, session_id: str) -> Waits[bool]:
        self._release(session_id, send_it=False)  # nobody reads its verdict any more
        return (yield from super().close_session(session_id))


def held_lockstep_router(
    verifier: Verifier,
    drafter: Drafter | None,
    target: LoadedModel,
    **options: Unpack[RouterOptions],
) -> Router:
    """`cluster.local.local_router(verifier, drafter, target, verifier_advances=False,
    **options)` with its verifier a `HeldVerifier`: every token through a posted block, and a
    pipelined block's successor verified ahead of its verdict."""
    options["verifier_advances"] = False
    options.setdefault("decode_special", text_decoder(target.tokenizer, skip_special_tokens=False))
    options.setdefault(
        "grammar_tokenizer", grammar_tokenizer_of(target.tokenizer, target.eos_token_ids)
    )
    return Router(
        HeldVerifier(verifier),
        None if drafter is None else InProcess(drafter),
        text_decoder(target.tokenizer),
        target.eos_token_ids,
        **options,
    )


@dataclass(frozen=True)
class Routers:
    """Two routers over the same replicas: the default one (its verifier sessions run, taking
    the target's own tokens whenever no block is there) and a lockstep one
    (`held_lockstep_router`: every token, the first included, decided by a posted block)."""

    running: Router
    lockstep: Router

    def __call__(self, lockstep: bool) -> Router:
        return self.lockstep if lockstep else self.running

    def close(self) -> None:
        self.running.close()
        self.lockstep.close()


def router_pair(
    verifier: Verifier, drafter: Drafter | None, target: LoadedModel, **options: Any
) -> Routers:
    """`Routers` over `verifier` and `drafter`, both with `options` (`RouterOptions`)."""
    return Routers(
        local_router(verifier, drafter, target, **options),
        held_lockstep_router(verifier, drafter, target, **options),
    )
