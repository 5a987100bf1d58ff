"""The frame codec bench: both encodings carry a frame's content exactly, and the bench runs."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch

from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.sparse_distribution import SparseDistribution
from experiments.frame_codec import (
    GREEDY,
    build_frames,
    check_round_trip,
    format_table,
    main,
    run,
    same_entries,
    same_results,
)
from experiments.frame_forms import CODECS, MsgpackFrames, ProtobufFrames, VerifyEntry

VOCAB = 300


def _odd_row() -> SparseDistribution:
    """Probabilities whose bits a lossy codec would change: -0.0, a subnormal, a NaN with a
    payload, infinity, and the float32 nearest 0.7; ids at both ends of int32."""
    bits = np.array([0x80000000, 0x00000001, 0x7FC00123, 0x7F800000, 0x3F333333], dtype=np.uint32)
    probs = torch.from_numpy(bits.view(np.float32).copy())
    return SparseDistribution(torch.tensor([0, 1, 7, VOCAB - 1, 2**31 - 1]), probs)


@pytest.mark.parametrize("codec", [make() for make in CODECS], ids=lambda c: c.name)
def test_each_codec_returns_q_rows_bit_for_bit(codec: ProtobufFrames | MsgpackFrames) -> None:
    row = _odd_row()
    block = DraftBlock(base_length=2**40, tokens=(5, 6, 7, 8, 9), draft_probs=(row,) * 5)
    sent = [VerifyEntry(tag=2**63, session_id="0" * 32, block=block, defer_bonus=True)]
    back = codec.decode_router(codec.encode_router(sent))
    assert same_entries(back, sent)
    got = back[0].block.draft_probs
    assert got is not None
    assert got[0].token_ids.dtype == torch.int64 and got[0].probs.dtype == torch.float32
    assert got[0].probs.view(torch.int32).tolist() == row.probs.view(torch.int32).tolist()


def test_the_comparison_sees_a_changed_bit() -> None:
    """`same_entries` is what the bench trusts: a NaN's payload or -0.0 against 0.0 must count
    as a difference, and so must a greedy block (no rows) against one with rows."""
    row = _odd_row()
    flipped = row.probs.clone()
    flipped.view(torch.int32)[0] = 0  # -0.0 becomes 0.0, which == calls equal
    block = DraftBlock(1, (1,) * 5, (row,) * 5)
    entry = VerifyEntry(1, "s", block)
    other = VerifyEntry(
        1, "s", DraftBlock(1, (1,) * 5, (SparseDistribution(row.token_ids, flipped),) * 5)
    )
    assert same_entries([entry], [entry])
    assert not same_entries([entry], [other])
    assert not same_entries([entry], [VerifyEntry(1, "s", DraftBlock(1, (1,) * 5))])


@pytest.mark.parametrize("row_size", [GREEDY, 8, VOCAB])
def test_both_codecs_carry_the_same_frames(row_size: int) -> None:
    frames = build_frames(sessions=3, row_size=row_size, vocab=VOCAB, seed=1)
    check_round_trip([make() for make in CODECS], frames)
    protobuf, msgpack = ProtobufFrames(), MsgpackFrames()
    assert same_results(
        protobuf.decode_replica(protobuf.encode_replica(frames.blocks)),
        msgpack.decode_replica(msgpack.encode_replica(frames.blocks)),
    )
    relayed = msgpack.decode_router(
        msgpack.relay(msgpack.encode_replica(frames.blocks), frames.session_ids)
    )
    assert [entry.block.load for entry in relayed] == [None] * 3
    assert same_entries(
        relayed,
        protobuf.decode_router(
            protobuf.relay(protobuf.encode_replica(frames.blocks), frames.session_ids)
        ),
    )


def test_a_relay_that_lost_a_row_is_caught() -> None:
    frames = build_frames(sessions=2, row_size=8, vocab=VOCAB, seed=2)
    with pytest.raises(AssertionError, match="relayed"):
        check_round_trip([_DroppingRelay()], frames)


class _DroppingRelay(MsgpackFrames):
    """Round-trips faithfully but relays every block but the first."""

    name = "dropping"

    def relay(self, data: bytes, session_ids: Mapping[int, str]) -> bytes:
        entries = self.decode_router(super().relay(data, session_ids))
        return self.encode_router(entries[1:])


def test_the_bench_runs_on_tiny_frames(tmp_path: Path) -> None:
    out = tmp_path / "frame_codec.json"
    assert (
        main(
            [
                "--sessions",
                "1",
                "2",
                "--vocab",
                str(VOCAB),
                "--top",
                "8",
                "--repeats",
                "2",
                "--target-ms",
                "0.05",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    frames = {(c["frame"], c["q_row_ids"], c["sessions"]) for c in result["cases"]}
    assert ("verdict", "none", 2) in frames and ("relay", f"{VOCAB} (dense)", 1) in frames
    assert len(result["cases"]) == 2 * (3 + 2 * 2 + 2)  # a size: 3 greedy, 2x2 sampled, 2 relays
    dense = next(
        c
        for c in result["cases"]
        if c["frame"] == "verify" and c["q_row_ids"] == f"{VOCAB} (dense)"
    )
    # Four rows of VOCAB int32 ids and VOCAB float32 probs, plus a little framing.
    assert all(4 * 8 * VOCAB < size < 4 * 8 * VOCAB + 200 for size in dense["bytes"].values())
    assert all(
        t[clock]["median_us"] > 0
        for c in result["cases"]
        for op in c["timings"].values()
        for t in op.values()
        for clock in ("cpu", "wall")
    )
    table = format_table(result)
    assert "| relay | 8 | 2 |" in table and "| verdict | none | 1 |" in table


def test_run_covers_every_frame_kind() -> None:
    result = run(sessions=(1,), vocab=50, top=4, repeats=1, target_ms=0.01, report=lambda _: None)
    assert {c["frame"] for c in result["cases"]} == {"verify", "block", "verdict", "relay"}
