"""Where a draft block stands against its session's committed tokens: rebased, or stale.

A running verifier session (`cluster.runtime.advance`) advances on its own while its router
turns around, and a router may send a block drafted ahead of blocks not yet verified (its
`assumed` tokens). So by the time a block reaches the verifier (or is about to leave the
router), the session may hold tokens past the block's base. The block is still a draft of the
tokens after them if the session committed exactly what the block takes for granted: its
assumed tokens, then its own first tokens. It is then verified from the session's committed
length, its first `skip` tokens (the ones the session already holds) counted as matched.
Anything else makes it stale: the session parted from it, or already holds all of it.

Exact under every acceptance rule: the session's tokens are the target's own (greedy choices,
seed-exact draws, or samples of p), and a draft is drawn without the verifier's randomness, so
given that its first tokens came out as the session's, its remaining tokens are a draft from q
after those very tokens (with their q rows), independent of the draws that test them.

`reconcile` is the verifier's test; `rebase` is the router's, which also keeps a block whose
assumed tokens the history has not reached yet (the block before it is still being verified).
Pure, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.kv_cache import common_prefix_length


@dataclass(frozen=True)
class Standing:
    """A block against its session: how many of its own tokens the session already holds,
    and whether it is stale."""

    skip: int
    """The block's first tokens the session committed already (the same ones)."""
    dropped: bool


def reconcile(since_base: Sequence[int], assumed: Sequence[int], tokens: Sequence[int]) -> Standing:
    """`since_base`: the session's committed tokens from the block's base length on;
    `assumed` and `tokens`: the block's (`DraftBlock.assumed`, `DraftBlock.tokens`).

    Verified from where the session stands when it holds the assumed tokens, then the block's
    first `skip` tokens, and not all of them (an empty block: the target's next token, only
    where the session stands at its base); dropped otherwise, `skip` then counting the block's
    own tokens that agreed (0 if it parted within the assumed ones). A session that has not
    reached the block's first token (it stopped inside the assumed tokens) drops it too: on a
    verifier, the block that should have brought it there was not accepted whole."""
    held, num_assumed = len(since_base), len(assumed)
    if held < num_assumed or list(since_base[:num_assumed]) != list(assumed):
        return Standing(0, dropped=True)
    past = since_base[num_assumed:]
    if not tokens:  # the target's own next token, wanted where the session stood
        return Standing(0, dropped=bool(past))
    agreed = common_prefix_length(past, tokens[: len(past)])
    if agreed < len(past) or agreed >= len(tokens):
        return Standing(agreed, dropped=True)
    return Standing(agreed, dropped=False)


def rebase(block: DraftBlock, since_base: Sequence[int]) -> DraftBlock | None:
    """`block` based where the committed tokens now end (`since_base`: those from its base on),
    its assumed and own tokens that are committed now left out (q rows with them); None when
    it is stale. A block whose assumed tokens the history has only begun to reach keeps the
    rest of them."""
    if not since_base:
        return block
    held, assumed = len(since_base), block.assumed
    base = block.base_length + held
    if held < len(assumed):
        if list(since_base) != list(assumed[:held]):
            return None
        return DraftBlock(base, block.tokens, block.draft_probs, block.load, assumed[held:])
    standing = reconcile(since_base, assumed, block.tokens)
    if standing.dropped:
        return None
    skip, probs = standing.skip, block.draft_probs
    return DraftBlock(
        base, block.tokens[skip:], None if probs is None else probs[skip:], block.load
    )
