"""`cluster.api.response`: merging a request's pending chunks (`merge`, `coalesce`).

The Serve faces send a lagging client what is pending as one chunk, so merging must never
change what the client reads: whatever the split into pending runs, the merged chunks
concatenate to the same tokens and text, end with the same finish reason, usage and counters,
and carry a finish reason only on the last one.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.api.response import ApiChunk, Usage, coalesce, merge
from cluster.routing.request import FinishReason, SpeculationStats

STATS = SpeculationStats(num_drafted=8, num_accepted=5, num_verify_passes=3)


def test_merge_concatenates_and_keeps_the_last_chunks_ending() -> None:
    first = ApiChunk("r", (1, 2), "ab")
    last = ApiChunk("r", (3,), "c", FinishReason.LENGTH, Usage(4, 3), STATS)
    assert merge([first, last]) == ApiChunk("r", (1, 2, 3), "abc", FinishReason.LENGTH,
                                            Usage(4, 3), STATS)  # fmt: skip
    assert merge([first]) is first
    with pytest.raises(ValueError, match="at least one"):
        merge([])


def test_a_finish_reason_ends_a_merge() -> None:
    done = ApiChunk("r", (1,), "a", FinishReason.STOP, Usage(1, 1), STATS)
    after = ApiChunk("r", (2,), "b")
    assert coalesce([done, after]) == [done, after]
    assert coalesce([after, done]) == [merge([after, done])]
    assert coalesce([]) == []


@st.composite
def streams(draw: st.DrawFn) -> list[ApiChunk]:
    """A stream as the service yields it: chunks of tokens and text (possibly empty, as a
    chunk holding an incomplete character is), the last with a finish reason and usage."""
    pieces = draw(
        st.lists(
            st.tuples(st.lists(st.integers(0, 300), max_size=4), st.text(max_size=5)),
            min_size=1,
            max_size=12,
        )
    )
    reason = draw(st.sampled_from(list(FinishReason)))
    chunks = [ApiChunk("r", tuple(tokens), text) for tokens, text in pieces]
    generated = sum(len(chunk.tokens) for chunk in chunks)
    chunks[-1] = ApiChunk(
        "r", chunks[-1].tokens, chunks[-1].text, reason, Usage(7, generated), STATS
    )
    return chunks


@given(streams(), st.data())
def test_any_split_merged_reads_the_same(chunks: list[ApiChunk], data: st.DataObject) -> None:
    cut_points = st.sets(st.integers(1, len(chunks) - 1)) if len(chunks) > 1 else st.just(set())
    cuts = sorted(data.draw(cut_points))
    runs = [chunks[a:b] for a, b in zip([0, *cuts], [*cuts, len(chunks)], strict=True)]
    merged = [chunk for run in runs for chunk in coalesce(run)]
    assert len(merged) == len(runs) <= len(chunks)
    assert tuple(t for c in merged for t in c.tokens) == tuple(t for c in chunks for t in c.tokens)
    assert "".join(c.text for c in merged) == "".join(c.text for c in chunks)
    assert merged[-1].finish_reason == chunks[-1].finish_reason
    assert (merged[-1].usage, merged[-1].stats) == (chunks[-1].usage, chunks[-1].stats)
    assert all(not c.finished and c.usage is None for c in merged[:-1])
    assert {c.request_id for c in merged} == {"r"}
