"""The suffix index: a corpus of token-id documents that proposes how a context goes on, from
what followed the same text before. The pure core of the suffix drafter (SuffixDecoding,
Arctic Inference): no model, no I/O, no locks; `drafter.suffix_store` holds one per tenant.

How a proposal is made (`SuffixIndex.propose`), like a walk down a suffix tree:

1. the occurrences of the context's last `min_match` tokens are read from an n-gram index,
   newest first, at most `max_candidates` of them; only occurrences followed by a token are
   indexed, so the context's own tail (the request's document is in the corpus too) is never
   a match with nothing after it;
2. each is compared backwards with the context, up to `max_match` tokens, and only the
   longest-matching ones are kept (`Proposal.match_length`);
3. the walk goes forward: at each step the next token of every surviving occurrence is
   counted, the most frequent wins (a tie goes to the most recent occurrence's), its share of
   the occurrences that have a next token multiplies the running confidence, and the
   occurrences that disagree drop out. The block ends before a token that would take the
   confidence below `min_confidence`, at `max_tokens`, or where no occurrence goes on. An
   occurrence that reaches its document's end (a live request's tail) says nothing about
   what follows, so it leaves the count rather than counting against the winner. A block is
   also at most `tokens_per_match` tokens per matched token (SuffixDecoding's length cap,
   proportional to the match): a 2-token match drafts at most 2.

Costs: `extend` is O(tokens added) (each token links one n-gram occurrence); `propose` is
O(max_candidates x (max_match + tokens proposed)), whatever the corpus size. Measured on one
core (CPython 3.11) over 1M tokens in 2000 documents, default config but no cap, a 16-token
recurring context: `propose` 17 us (ids drawn from 5000, 138 MB accounted) to 36 us (from 50: every
n-gram recurs hundreds of times, 21 MB); `extend` of 16 tokens 13-16 us.

Layout: each document holds its tokens in an `array('i')` and two `array('q')` of links, so
that the occurrences of one n-gram form a doubly linked list threaded through the documents,
newest first, whose head is the only per-n-gram object (`_heads`, keyed by the n-gram packed
into one int). Dropping a document unlinks each of its occurrences in O(1): nothing stale is
left behind, and memory follows what is held. A position is packed as (document serial << 32)
| offset; `_NONE` ends a list.

`nbytes` is an accounting, not a measurement (`TOKEN_BYTES` and its neighbours): it is kept
exactly from the counts, so that eviction is deterministic and cheap, and `extend` never lets
it pass `tenant_bytes`.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.runtime.errors import InvalidArgumentError
from drafter.config import SuffixConfig

# Calibrated with tracemalloc on CPython 3.11, 200k tokens in 20 documents extended 16 tokens
# at a time: 20.3 bytes a token when ids come from a vocabulary of 10 (100 distinct n-grams in
# all), and 120 bytes more for each distinct n-gram when nearly every n-gram is new (random ids
# over 1M); 474 bytes a document for 20k one-token documents, their names not counted.
TOKEN_BYTES = 20
"""A token held: its id (4 bytes) and its two links (8 each), arrays' slack included."""
HEAD_BYTES = 84
"""A distinct n-gram, less its key: its slot in `_heads` and its head (a Python int)."""
DOC_BYTES = 512
"""A document: its record, three arrays, its entries in two dicts."""

_NONE = -1
"""The end of an occurrence list (no older, or no newer, occurrence)."""
_OFFSET_BITS = 32
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1
_TOKEN_LIMIT = 1 << 31
"""Token ids are stored as C ints, and packed 32 bits each into n-gram keys."""


@dataclass(frozen=True)
class Proposal:
    """A drafted block and how sure the index is of it."""

    tokens: tuple[int, ...]
    """() when nothing recurs."""
    confidence: float
    """The running confidence after the last token (1.0 for ())."""
    match_length: int
    """Tokens of the context's suffix matched by the occurrences drafted from (0: none)."""


NO_PROPOSAL = Proposal(tokens=(), confidence=1.0, match_length=0)


class _Document:
    """One document: its tokens and, per position `e`, the links of the occurrence of the
    n-gram that ends just before `e` (tokens[e - min_match : e], followed by tokens[e])."""

    __slots__ = ("full", "newer", "older", "serial", "tokens")

    def __init__(self, serial: int) -> None:
        self.serial = serial
        self.tokens = array("i")
        self.older = array("q")
        """The next older occurrence of the same n-gram, packed, or `_NONE`."""
        self.newer = array("q")
        """The next newer occurrence, packed, or `_NONE` (this one is the list's head)."""
        self.full = False
        """The cap stopped this document: later tokens would not follow the ones held."""


class SuffixIndex:
    """One corpus of documents (token-id sequences); proposes continuations of a context."""

    def __init__(self, config: SuffixConfig) -> None:
        self._config = config
        self._docs: dict[str, _Document] = {}
        """By name, oldest first (creation order is eviction order)."""
        self._by_serial: dict[int, _Document] = {}
        self._heads: dict[int, int] = {}
        """Packed n-gram -> its newest occurrence, packed."""
        self._next_serial = 0
        self._num_tokens = 0
        self._key_mask = (1 << (_OFFSET_BITS * config.min_match)) - 1
        self._key_bytes = HEAD_BYTES + sys.getsizeof(self._key_mask)
        """Accounted per distinct n-gram: 120 at min_match 2."""

    @property
    def nbytes(self) -> int:
        """Accounted memory of what the index holds."""
        return (
            TOKEN_BYTES * self._num_tokens
            + self._key_bytes * len(self._heads)
            + DOC_BYTES * len(self._docs)
        )

    @property
    def documents(self) -> int:
        return len(self._docs)

    @property
    def tokens(self) -> int:
        """Tokens held, over all documents."""
        return self._num_tokens

    def __contains__(self, doc: object) -> bool:
        return doc in self._docs

    def extend(self, doc: str, tokens: Sequence[int]) -> None:
        """Append tokens to document `doc` (created, as the newest, if unknown), indexing them;
        then evict the oldest documents while `nbytes` > config.tenant_bytes (never leave it over
        the cap: if one document alone would pass the cap, stop indexing its further tokens)."""
        added = _checked(tokens)
        document = self._docs.get(doc)
        cap = self._config.tenant_bytes
        if document is None:
            while self.nbytes + DOC_BYTES > cap:
                if not self._evict_other(doc):
                    return
            document = self._create(doc)
        if document.full:
            return
        m = self._config.min_match
        held = document.tokens
        key = _pack(held[-m:])  # rolls on: the n-gram ending before the next token
        for token in added:
            end = len(held)
            indexed = end >= m
            # An eviction may drop this n-gram's last occurrence: price the token afresh.
            while self.nbytes + self._cost(indexed and key not in self._heads) > cap:
                if not self._evict_other(doc):
                    document.full = True
                    return
            held.append(token)
            self._num_tokens += 1
            if indexed:
                here = (document.serial << _OFFSET_BITS) | end
                older = self._heads.get(key, _NONE)
                if older != _NONE:
                    self._document(older).newer[older & _OFFSET_MASK] = here
                self._heads[key] = here
                document.older.append(older)
            else:
                document.older.append(_NONE)
            document.newer.append(_NONE)
            key = ((key << _OFFSET_BITS) | token) & self._key_mask

    def drop(self, doc: str) -> None:
        """Remove a document and its index entries; an unknown document is a no-op."""
        document = self._docs.pop(doc, None)
        if document is None:
            return
        m = self._config.min_match
        held = document.tokens
        key = _pack(held[:m])
        for end in range(m, len(held)):
            older, newer = document.older[end], document.newer[end]
            if newer == _NONE:
                if older == _NONE:
                    del self._heads[key]
                else:
                    self._heads[key] = older
            else:
                self._link_older(newer, older)
            if older != _NONE:
                self._link_newer(older, newer)
            key = ((key << _OFFSET_BITS) | held[end]) & self._key_mask
        del self._by_serial[document.serial]  # after: its own occurrences link to each other
        self._num_tokens -= len(held)

    def propose(self, context: Sequence[int], max_tokens: int) -> Proposal:
        """Up to min(`max_tokens`, config.max_tokens) tokens continuing `context` (the request's
        whole committed sequence, or at least its last `max_match` tokens)."""
        config = self._config
        budget = min(max_tokens, config.max_tokens)
        m = config.min_match
        if budget < 1 or len(context) < m:
            return NO_PROPOSAL
        tail = list(context[-config.max_match :])
        if not all(0 <= token < _TOKEN_LIMIT for token in tail[-m:]):
            return NO_PROPOSAL  # never held, and would not pack into a key
        position = self._heads.get(_pack(tail[-m:]), _NONE)
        # Survivors: (a document's tokens, the offset of their next token), newest first.
        survivors: list[tuple[array[int], int]] = []
        match_length = 0
        for _ in range(config.max_candidates):
            if position == _NONE:
                break
            document = self._document(position)
            held, end = document.tokens, position & _OFFSET_MASK
            length = m
            limit = min(len(tail), end)
            while length < limit and held[end - length - 1] == tail[-length - 1]:
                length += 1
            if length > match_length:
                match_length, survivors = length, [(held, end)]
            elif length == match_length:
                survivors.append((held, end))
            position = document.older[end]
        if config.tokens_per_match > 0:  # a short match earns a short block
            budget = min(budget, max(1, int(config.tokens_per_match * match_length)))
        drafted: list[int] = []
        confidence = 1.0
        while survivors and len(drafted) < budget:
            counts: dict[int, int] = {}  # in survivor order, so a tie keeps the newest's
            for held, end in survivors:
                if end < len(held):
                    token = held[end]
                    counts[token] = counts.get(token, 0) + 1
            if not counts:
                break
            token, count = max(counts.items(), key=lambda item: item[1])
            share = count / sum(counts.values())
            if confidence * share < config.min_confidence:
                break
            confidence *= share
            drafted.append(token)
            survivors = [
                (held, end + 1) for held, end in survivors if end < len(held) and held[end] == token
            ]
        if not drafted:
            return Proposal(tokens=(), confidence=1.0, match_length=match_length)
        return Proposal(tokens=tuple(drafted), confidence=confidence, match_length=match_length)

    def _create(self, doc: str) -> _Document:
        document = _Document(self._next_serial)
        self._next_serial += 1
        self._docs[doc] = document
        self._by_serial[document.serial] = document
        return document

    def _evict_other(self, doc: str) -> bool:
        """Drop the oldest document other than `doc`; False if there is none."""
        victim = next((name for name in self._docs if name != doc), None)
        if victim is None:
            return False
        self.drop(victim)
        return True

    def _cost(self, new_key: bool) -> int:
        """The accounted bytes one more token adds."""
        return TOKEN_BYTES + (self._key_bytes if new_key else 0)

    def _document(self, position: int) -> _Document:
        return self._by_serial[position >> _OFFSET_BITS]

    def _link_older(self, position: int, older: int) -> None:
        self._document(position).older[position & _OFFSET_MASK] = older

    def _link_newer(self, position: int, newer: int) -> None:
        self._document(position).newer[position & _OFFSET_MASK] = newer


def _pack(tokens: Sequence[int]) -> int:
    """An n-gram as one int, 32 bits a token, the last token lowest."""
    key = 0
    for token in tokens:
        key = (key << _OFFSET_BITS) | token
    return key


def _checked(tokens: Sequence[int]) -> array[int]:
    try:
        held = array("i", tokens)
    except (OverflowError, TypeError) as error:
        raise InvalidArgumentError(f"token ids must be ints in [0, 2**31): {error}") from None
    if held and min(held) < 0:
        raise InvalidArgumentError(f"token ids must be >= 0, got {min(held)}")
    return held
