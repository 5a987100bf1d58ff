"""The suffix store: tenants never draft from each other's text, the two scopes keep what they
promise, and the counters count."""

from __future__ import annotations

import sys
import threading

from drafter.config import SuffixConfig
from drafter.suffix_index import NO_PROPOSAL
from drafter.suffix_store import StoreStats, SuffixStore

TENANT = SuffixConfig(scope="tenant", min_confidence=0.0, tokens_per_match=0.0)
REQUEST = SuffixConfig(scope="request", min_confidence=0.0, tokens_per_match=0.0)
SECRET = [11, 12, 13, 14, 15, 16]


def test_a_tenant_never_drafts_from_another_tenants_text() -> None:
    """Tenant B's context is the start of what only tenant A wrote: one index shared by both
    would propose the rest of it."""
    for config in (TENANT, REQUEST):
        store = SuffixStore(config)
        store.extend("a", "a-1", SECRET)
        store.extend("b", "b-1", [1, 11, 12])
        assert store.propose("b", "b-1", [1, 11, 12], 4) == NO_PROPOSAL
        store.extend("b", "b-1", [13, 1, 11])  # b's own text drafts for b
        assert store.propose("b", "b-1", [1, 11, 12, 13, 1, 11], 4).tokens == (12, 13, 1, 11)
        assert store.propose("a", "a-1", [11, 12], 2).tokens == (13, 14)
        # Unknown tenants and requests get nothing, and no index is made for them.
        assert store.propose("c", "c-1", [11, 12], 2) == NO_PROPOSAL
        assert store.stats().indexes == 2


def test_scope_tenant_drafts_across_a_tenants_requests_and_keeps_them() -> None:
    store = SuffixStore(TENANT)
    store.extend("a", "a-1", SECRET)
    store.finish("a", "a-1")
    store.extend("a", "a-2", [9, 11, 12])
    assert store.propose("a", "a-2", [9, 11, 12], 3).tokens == (13, 14, 15)
    assert store.tenant_stats("a") == StoreStats(
        indexes=1,
        documents=2,
        tokens=9,
        nbytes=store.tenant_stats("a").nbytes,
        proposals=1,
        proposed=1,
        proposed_tokens=3,
    )


def test_scope_request_drafts_from_the_request_alone_and_drops_it_at_finish() -> None:
    store = SuffixStore(REQUEST)
    store.extend("a", "a-1", SECRET)
    store.extend("a", "a-2", [9, 11, 12, 7, 9, 11])
    # a-1's text is the same tenant's, but not this request's.
    assert store.propose("a", "a-2", [9, 11, 12, 7, 9, 11, 12], 3).tokens == (7, 9, 11)
    assert store.propose("a", "a-2", [5, 13, 14], 3) == NO_PROPOSAL
    assert store.propose("a", "a-1", [11, 12], 2).tokens == (13, 14)
    assert store.tenant_stats("a").indexes == 2
    store.finish("a", "a-1")
    assert store.propose("a", "a-1", [11, 12], 2) == NO_PROPOSAL
    assert (store.tenant_stats("a").indexes, store.tenant_stats("a").tokens) == (1, 6)
    store.finish("a", "a-2")
    store.finish("a", "unknown")
    stats = store.tenant_stats("a")
    assert (stats.indexes, stats.documents, stats.tokens, stats.nbytes) == (0, 0, 0, 0)
    assert (stats.proposals, stats.proposed, stats.proposed_tokens) == (4, 2, 5)


def test_stats_count_every_tenant_and_zeros_for_an_unknown_one() -> None:
    store = SuffixStore(TENANT)
    store.extend("a", "a-1", SECRET)
    store.extend("b", "b-1", [1, 2, 3, 1, 2])
    store.propose("a", "a-1", [11, 12], 2)
    store.propose("b", "b-1", [1, 2], 4)
    store.propose("b", "b-1", [4, 5], 4)
    a, b = store.tenant_stats("a"), store.tenant_stats("b")
    assert a.nbytes > 0 and b.nbytes > 0
    assert store.stats() == StoreStats(
        indexes=2,
        documents=2,
        tokens=11,
        nbytes=a.nbytes + b.nbytes,
        proposals=3,
        proposed=2,
        proposed_tokens=5,
    )
    assert store.tenant_stats("nobody") == StoreStats(0, 0, 0, 0, 0, 0, 0)


def test_concurrent_calls_on_one_tenant_lose_nothing() -> None:
    """Eight threads writing and reading one tenant's index at once, switching threads as
    often as the interpreter allows: every token and every call is counted, and no call
    fails (without the lock, links go stale under a thread's feet within a few calls)."""
    store = SuffixStore(TENANT)
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for step in range(300):
                store.extend("a", f"{worker}-{step % 3}", [step % 7, step % 5])
                store.propose("a", f"{worker}-0", [step % 7, step % 5], 4)
        except Exception as error:  # any failure is the finding
            errors.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(worker,)) for worker in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    stats = store.stats()
    assert (stats.indexes, stats.documents, stats.tokens) == (1, 24, 8 * 300 * 2)
    assert stats.proposals == 8 * 300


def test_a_private_request_drafts_from_its_own_text_only_and_leaves_none() -> None:
    store = SuffixStore(TENANT)
    store.extend("a", "shared", SECRET)
    store.keep_private("sampled")
    store.extend("a", "sampled", [9, 11, 12, 7, 9, 11])
    # The tenant's text is not drafted from: only the request's own.
    assert store.propose("a", "sampled", [5, 13, 14], 3) == NO_PROPOSAL
    assert store.propose("a", "sampled", [9, 11, 12, 7, 9, 11, 12], 3).tokens == (7, 9, 11)
    store.finish("a", "sampled")
    # Nor is its text left for the tenant's later requests; the shared text still is.
    store.extend("a", "later", [1, 12, 7])
    assert store.propose("a", "later", [1, 12, 7], 2) == NO_PROPOSAL
    assert store.propose("a", "later", [1, 11, 12], 2).tokens == (13, 14)
    assert store.tenant_stats("a").indexes == 1
