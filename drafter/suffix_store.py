"""The suffix indexes of one replica, kept apart by tenant: the suffix drafter's state.

A request's text drafts only for its own tenant, never another's: what a draft proposes shows
in acceptance and timing, so a shared index would tell one tenant whether another wrote the
same text (`drafter.config.SuffixConfig.scope`). With scope "tenant" each tenant has one
`SuffixIndex`, each request a document in it, kept after the request ends for the tenant's
later requests until the tenant's cap evicts it; with scope "request" each request has an
index of its own, dropped when it ends.

A request opened `private` has an index of its own whatever the scope, dropped when it ends:
it neither drafts from the tenant's other text nor leaves its own there. The suffix drafter
opens so every request whose tokens the verifier samples by the rejection rule
(`drafter.suffix`): such a request's output depends on its seed's random stream, and a later
request with the same seed tests its draft with that very stream, so a draft made of the
earlier output would not be independent of the draws that test it (the rule's exactness
needs it to be).

Thread-safe: one lock over every call, as each is short (`drafter.suffix_index` costs).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from drafter.config import SuffixConfig
from drafter.suffix_index import NO_PROPOSAL, Proposal, SuffixIndex

_TENANT_WIDE = ""
"""Scope "tenant": the key of a tenant's one index among its indexes."""


@dataclass(frozen=True)
class StoreStats:
    """What the indexes hold, and how their proposals went."""

    indexes: int
    documents: int
    tokens: int
    nbytes: int
    proposals: int
    """`propose` calls."""
    proposed: int
    """Calls that proposed one token or more."""
    proposed_tokens: int


class _Counts:
    """One tenant's proposal counters."""

    __slots__ = ("proposals", "proposed", "proposed_tokens")

    def __init__(self) -> None:
        self.proposals = 0
        self.proposed = 0
        self.proposed_tokens = 0


class SuffixStore:
    """The indexes of one replica: one per tenant (scope "tenant"), or one per request (scope
    "request"); never shared across tenants. Thread-safe (one lock; calls are short)."""

    def __init__(self, config: SuffixConfig) -> None:
        self._config = config
        self._per_request = config.scope == "request"
        self._lock = threading.Lock()
        self._indexes: dict[str, dict[str, SuffixIndex]] = {}
        """Tenant -> its indexes, by request (scope "request") or under `_TENANT_WIDE`."""
        self._counts: dict[str, _Counts] = {}
        self._private: set[str] = set()
        """Requests with an index of their own whatever the scope (see the module doc)."""

    def keep_private(self, doc: str) -> None:
        """Request `doc` gets an index of its own, dropped when it ends (call before its first
        `extend`)."""
        with self._lock:
            self._private.add(doc)

    def extend(self, tenant: str, doc: str, tokens: Sequence[int]) -> None:
        """Append tokens to request `doc` of `tenant`, creating what it needs."""
        with self._lock:
            indexes = self._indexes.setdefault(tenant, {})
            key = self._key(doc)
            index = indexes.get(key)
            if index is None:
                index = indexes[key] = SuffixIndex(self._config)
            index.extend(doc, tokens)

    def propose(self, tenant: str, doc: str, context: Sequence[int], max_tokens: int) -> Proposal:
        """Up to `max_tokens` tokens continuing `context`, request `doc`'s committed tokens,
        drafted from what its tenant's index (or the request's own) holds."""
        with self._lock:
            index = self._indexes.get(tenant, {}).get(self._key(doc))
            proposal = NO_PROPOSAL if index is None else index.propose(context, max_tokens)
            counts = self._counts.get(tenant)
            if counts is None:
                counts = self._counts[tenant] = _Counts()
            counts.proposals += 1
            if proposal.tokens:
                counts.proposed += 1
                counts.proposed_tokens += len(proposal.tokens)
            return proposal

    def finish(self, tenant: str, doc: str) -> None:
        """The request ended: scope "tenant" keeps its text for later requests (until evicted);
        scope "request" drops it (and the request's index)."""
        with self._lock:
            if not self._per_request and doc not in self._private:
                return
            self._private.discard(doc)
            indexes = self._indexes.get(tenant)
            if indexes is not None and indexes.pop(doc, None) is not None and not indexes:
                del self._indexes[tenant]

    def stats(self) -> StoreStats:
        """Every tenant's, summed."""
        with self._lock:
            return _stats(
                [index for indexes in self._indexes.values() for index in indexes.values()],
                list(self._counts.values()),
            )

    def tenant_stats(self, tenant: str) -> StoreStats:
        """One tenant's (zeros if unknown)."""
        with self._lock:
            counts = self._counts.get(tenant)
            indexes = self._indexes.get(tenant, {})
            return _stats(list(indexes.values()), [] if counts is None else [counts])

    def _key(self, doc: str) -> str:
        return doc if self._per_request or doc in self._private else _TENANT_WIDE


def _stats(indexes: list[SuffixIndex], counts: list[_Counts]) -> StoreStats:
    return StoreStats(
        indexes=len(indexes),
        documents=sum(index.documents for index in indexes),
        tokens=sum(index.tokens for index in indexes),
        nbytes=sum(index.nbytes for index in indexes),
        proposals=sum(c.proposals for c in counts),
        proposed=sum(c.proposed for c in counts),
        proposed_tokens=sum(c.proposed_tokens for c in counts),
    )
