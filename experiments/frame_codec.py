"""What a stream frame's body costs as protobuf against msgpack: encode, decode, both, and size.

    python -m experiments.frame_codec --json frame_codec.json

A frame carries many sessions' entries (`RouterFrame` / `ReplicaFrame` in
`protos/replica.proto`); `experiments/frame_forms.py` holds the two encodings. For 1, 8
and 64 sessions a frame, it measures the frames that matter per round:

- `verify`: router -> verifier, one verify a session (a uuid-hex session id, a base length, 4
  draft tokens and their q rows);
- `block`: drafter -> router, one draft block a session (4 tokens, their q rows, the load);
- `verdict`: verifier -> router, one verdict a session (3 tokens, the load);
- `relay`: a drafter's frame of blocks in, the verifier's frame of verifies out, the q rows
  passed through as bytes (`untouched`) or turned into tensors and back (`via tensors`).

q rows come three ways: none (a greedy draft), sparse (`--top` ids a row: a top-k drafter) and
dense (`--vocab` ids a row: a drafter with no top-k). Encode starts from plain values (Python
ints and lists, torch tensors for q rows) and decode ends at them; the round trip is both,
timed together. Every figure is the median over `--repeats` of a timed run of many calls
(enough for `--target-ms` of CPU time a run); the two codecs alternate within each repeat, so a
busy machine slows both alike. Each run is timed on two clocks: the thread's CPU time, which
other processes on a shared machine do not inflate, and wall time (`time.perf_counter_ns`),
which they do; the table comes once for each. Before timing, each frame is checked to come back
with the same content from both codecs, q rows bit for bit.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import random
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch
from google.protobuf import __version__ as protobuf_version
from google.protobuf.internal import api_implementation

from cluster.runtime.draft_block import DraftBlock, StepLoad, Verdict
from cluster.runtime.sparse_distribution import SparseDistribution
from cluster.tools.bench.output import figure, progress
from experiments.frame_forms import CODECS, Result, VerifyEntry

SESSIONS = (1, 8, 64)
DRAFT_TOKENS = 4
VERDICT_TOKENS = 3
VOCAB = 32000
TOP = 64
REPEATS = 21
TARGET_MS = 2.0
MAX_CALLS = 20000
GREEDY = 0
"""q rows of `GREEDY` ids: none at all (a deterministic draft sends no q)."""

Codec = Any
"""`ProtobufFrames` or `MsgpackFrames`: the same five methods."""


def _row(rng: torch.Generator, size: int, vocab: int) -> SparseDistribution:
    """A q row over `size` ids of `vocab` (all of them when equal), as a sampler leaves it:
    ids ascending, softmax probabilities in float32."""
    ids = torch.arange(vocab) if size >= vocab else torch.randperm(vocab, generator=rng)[:size]
    logits = torch.randn(len(ids), generator=rng)
    return SparseDistribution(ids.sort().values, torch.softmax(logits, dim=0))


def _load(sessions: int) -> StepLoad:
    return StepLoad(sessions, sessions * (DRAFT_TOKENS + 1), 0.0061, 2.3e-5)


@dataclasses.dataclass(frozen=True)
class Frames:
    """One size's plain frames: the verifies a router sends, the blocks and verdicts it gets
    back, and the session id of each tag."""

    verifies: list[VerifyEntry]
    blocks: list[Result]
    verdicts: list[Result]
    session_ids: dict[int, str]


def build_frames(sessions: int, row_size: int, vocab: int, seed: int) -> Frames:
    """`sessions` sessions' frames, with q rows of `row_size` ids (`GREEDY`: none)."""
    rng, draw = torch.Generator().manual_seed(seed), random.Random(seed)
    verifies, blocks, verdicts, session_ids = [], [], [], {}
    for tag in range(1000, 1000 + sessions):
        session_ids[tag] = uuid.UUID(int=draw.getrandbits(128)).hex
        base = draw.randrange(100, 4000)
        tokens = tuple(draw.randrange(vocab) for _ in range(DRAFT_TOKENS))
        rows = tuple(_row(rng, row_size, vocab) for _ in tokens) if row_size else None
        block = DraftBlock(base, tokens, rows)
        verifies.append(VerifyEntry(tag, session_ids[tag], block))
        blocks.append(Result(tag, dataclasses.replace(block, load=_load(sessions))))
        verdict_tokens = (*tokens[: VERDICT_TOKENS - 1], draw.randrange(vocab))
        verdicts.append(
            Result(
                tag,
                Verdict(
                    base,
                    VERDICT_TOKENS - 1,
                    verdict_tokens,
                    base + VERDICT_TOKENS,
                    False,
                    _load(sessions),
                ),
            )
        )
    return Frames(verifies, blocks, verdicts, session_ids)


def _same_value(a: object, b: object) -> bool:
    """Equal plain values, q rows compared bit for bit (dtype, shape and bytes)."""
    if isinstance(a, DraftBlock) and isinstance(b, DraftBlock):
        rows_a, rows_b = a.draft_probs or (), b.draft_probs or ()
        return (
            (a.base_length, a.tokens, a.load, a.draft_probs is None)
            == (b.base_length, b.tokens, b.load, b.draft_probs is None)
            and len(rows_a) == len(rows_b)
            and all(_same_row(x, y) for x, y in zip(rows_a, rows_b, strict=True))
        )
    return type(a) is type(b) and a == b


def _same_row(a: SparseDistribution, b: SparseDistribution) -> bool:
    return all(
        x.dtype == y.dtype and x.shape == y.shape and x.numpy().tobytes() == y.numpy().tobytes()
        for x, y in ((a.token_ids, b.token_ids), (a.probs, b.probs))
    )


def same_entries(a: Sequence[VerifyEntry], b: Sequence[VerifyEntry]) -> bool:
    return len(a) == len(b) and all(
        (x.tag, x.session_id, x.defer_bonus) == (y.tag, y.session_id, y.defer_bonus)
        and _same_value(x.block, y.block)
        for x, y in zip(a, b, strict=True)
    )


def same_results(a: Sequence[Result], b: Sequence[Result]) -> bool:
    return len(a) == len(b) and all(
        x.tag == y.tag and _same_value(x.value, y.value) for x, y in zip(a, b, strict=True)
    )


def _relayed(frames: Frames) -> list[VerifyEntry]:
    """What the verifier should read from a relayed drafter frame: each block without its
    load (the drafter's, which the router keeps)."""
    return [
        VerifyEntry(r.tag, frames.session_ids[r.tag], dataclasses.replace(r.value, load=None))
        for r in frames.blocks
        if isinstance(r.value, DraftBlock)
    ]


def _via_tensors(codec: Codec, data: bytes, session_ids: dict[int, str]) -> bytes:
    """The relay the router does today: decode the blocks to tensors, encode them again."""
    return codec.encode_router(
        [
            VerifyEntry(r.tag, session_ids[r.tag], dataclasses.replace(r.value, load=None))
            for r in codec.decode_replica(data)
        ]
    )


def check_round_trip(codecs: Sequence[Codec], frames: Frames) -> None:
    """Raise AssertionError unless every codec returns each frame as it was given, relays a
    drafter's frame into the verifies it should, and the two relays agree."""
    for codec in codecs:
        name = codec.name
        if not same_entries(
            codec.decode_router(codec.encode_router(frames.verifies)), frames.verifies
        ):
            raise AssertionError(f"{name}: verifies do not round-trip")
        for results in (frames.blocks, frames.verdicts):
            if not same_results(codec.decode_replica(codec.encode_replica(results)), results):
                raise AssertionError(f"{name}: results do not round-trip")
        data = codec.encode_replica(frames.blocks)
        for relay in (
            codec.relay(data, frames.session_ids),
            _via_tensors(codec, data, frames.session_ids),
        ):
            if not same_entries(codec.decode_router(relay), _relayed(frames)):
                raise AssertionError(f"{name}: a relayed frame does not carry the drafter's blocks")


CLOCKS = ("cpu", "wall")
"""`cpu`: the thread's CPU time (`time.thread_time_ns`), which a busy machine's other processes
do not add to; `wall`: `time.perf_counter_ns`, which they do whenever they take the core."""
CLOCKS_SAID = {"cpu": "time.thread_time_ns", "wall": "time.perf_counter_ns"}


def _time_calls(call: Callable[[], object], calls: int) -> dict[str, float]:
    """Nanoseconds per call over `calls` calls, on each clock."""
    wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
    for _ in range(calls):
        call()
    cpu, wall = time.thread_time_ns() - cpu, time.perf_counter_ns() - wall
    return {"cpu": cpu / calls, "wall": wall / calls}


def _summary(values_us: list[float]) -> dict[str, float]:
    quartiles = statistics.quantiles(values_us, n=4) if len(values_us) > 1 else values_us * 3
    return {
        "median_us": statistics.median(values_us),
        "p25_us": quartiles[0],
        "p75_us": quartiles[-1],
        "min_us": min(values_us),
    }


def measure(
    ops: dict[str, dict[str, Callable[[], object]]], repeats: int, target_ms: float
) -> dict[str, dict[str, dict[str, Any]]]:
    """Per op and codec, on each clock: the median, p25, p75 and least microseconds a call
    over `repeats` timed runs, each of as many calls as fill about `target_ms` of CPU time; the
    codecs alternate within a repeat, and which goes first alternates between repeats."""
    calls: dict[str, dict[str, int]] = {}
    for op, by_codec in ops.items():
        calls[op] = {}
        for name, call in by_codec.items():
            call()  # warm up: caches, lazily built decoders
            once = _time_calls(call, 1)["cpu"]
            calls[op][name] = max(1, min(MAX_CALLS, int(target_ms * 1e6 / max(once, 1.0))))
    samples: dict[str, dict[str, list[dict[str, float]]]] = {
        op: {name: [] for name in by_codec} for op, by_codec in ops.items()
    }
    gc.collect()
    for repeat in range(repeats):
        for op, by_codec in ops.items():
            names = list(by_codec) if repeat % 2 == 0 else list(reversed(by_codec))
            for name in names:
                samples[op][name].append(_time_calls(by_codec[name], calls[op][name]))
    return {
        op: {
            name: {
                **{clock: _summary([run[clock] / 1000 for run in runs]) for clock in CLOCKS},
                "calls_per_run": calls[op][name],
            }
            for name, runs in by_codec_samples.items()
        }
        for op, by_codec_samples in samples.items()
    }


def _row_label(row_size: int, vocab: int) -> str:
    return (
        "none"
        if row_size == GREEDY
        else f"{row_size} (dense)"
        if row_size >= vocab
        else str(row_size)
    )


def run(
    sessions: Sequence[int] = SESSIONS,
    vocab: int = VOCAB,
    top: int = TOP,
    repeats: int = REPEATS,
    target_ms: float = TARGET_MS,
    seed: int = 0,
    report: Callable[[str], None] = progress,
) -> dict[str, Any]:
    """Every case at every size, checked then timed; the JSON the CLI writes."""
    codecs = [make() for make in CODECS]
    gc.collect()
    gc.freeze()  # the heap as it was: each case's collection (`measure`) need not scan it again
    try:
        cases = _cases(codecs, sessions, vocab, top, repeats, target_ms, seed, report)
    finally:
        gc.unfreeze()
    return {
        "config": {
            "sessions": list(sessions),
            "vocab": vocab,
            "top": top,
            "repeats": repeats,
            "target_ms": target_ms,
            "seed": seed,
            "draft_tokens": DRAFT_TOKENS,
            "verdict_tokens": VERDICT_TOKENS,
        },
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "protobuf": f"{protobuf_version} ({api_implementation.Type()})",
            "msgspec": msgspec.__version__,
        },
        "cases": cases,
    }


def _cases(
    codecs: Sequence[Codec],
    sessions: Sequence[int],
    vocab: int,
    top: int,
    repeats: int,
    target_ms: float,
    seed: int,
    report: Callable[[str], None],
) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    for size in sessions:
        for row_size in (GREEDY, top, vocab):
            frames = build_frames(size, row_size, vocab, seed)
            check_round_trip(codecs, frames)
            q = _row_label(row_size, vocab)
            kinds: list[tuple[str, Any, str, str]] = [
                ("verify", frames.verifies, "encode_router", "decode_router"),
                ("block", frames.blocks, "encode_replica", "decode_replica"),
            ]
            if row_size == GREEDY:
                kinds.append(("verdict", frames.verdicts, "encode_replica", "decode_replica"))
            for frame, plain, encode, decode in kinds:
                data = {c.name: getattr(c, encode)(plain) for c in codecs}
                ops = {
                    "encode": {c.name: _bind(getattr(c, encode), plain) for c in codecs},
                    "decode": {c.name: _bind(getattr(c, decode), data[c.name]) for c in codecs},
                    "round_trip": {
                        c.name: _chain(getattr(c, encode), getattr(c, decode), plain)
                        for c in codecs
                    },
                }
                cases.append(_case(frame, q, size, data, measure(ops, repeats, target_ms)))
                report(_progress_line(cases[-1]))
            if row_size == GREEDY:
                continue
            data = {c.name: c.encode_replica(frames.blocks) for c in codecs}
            ids = frames.session_ids
            ops = {
                "untouched": {c.name: _bind(c.relay, data[c.name], ids) for c in codecs},
                "via_tensors": {c.name: _bind(_via_tensors, c, data[c.name], ids) for c in codecs},
            }
            out = {c.name: c.relay(data[c.name], ids) for c in codecs}
            cases.append(_case("relay", q, size, out, measure(ops, repeats, target_ms)))
            report(_progress_line(cases[-1]))
    return cases


def _bind(function: Callable[..., object], *args: object) -> Callable[[], object]:
    return lambda: function(*args)


def _chain(
    encode: Callable[[Any], bytes], decode: Callable[[bytes], object], plain: object
) -> Callable[[], object]:
    return lambda: decode(encode(plain))


def _case(
    frame: str, q: str, sessions: int, data: dict[str, bytes], timings: dict[str, Any]
) -> dict[str, Any]:
    return {
        "frame": frame, "q_row_ids": q, "sessions": sessions,
        "bytes": {name: len(blob) for name, blob in data.items()}, "timings": timings,
    }  # fmt: skip


def _progress_line(case: dict[str, Any]) -> str:
    parts = [
        f"{op} " + " / ".join(f"{name} {t['cpu']['median_us']:.1f}" for name, t in by_codec.items())
        for op, by_codec in case["timings"].items()
    ]
    where = f"{case['frame']}, q {case['q_row_ids']}, {case['sessions']} sessions"
    return f"{where}: " + "; ".join(parts) + " us (cpu)"


def _us(value: float) -> str:
    return figure(value, 1 if value < 100 else 0)


def format_table(result: dict[str, Any], clock: str = "cpu") -> str:
    """Two markdown tables of `clock`'s medians in microseconds: the frames (per frame, and the
    round trip per entry), then the relays."""
    pb, mp = (make.name for make in CODECS)
    lines = [
        "| frame | q row ids | sessions | bytes pb | bytes mp | encode pb | encode mp "
        "| decode pb | decode mp | round trip pb | round trip mp | per entry pb | per entry mp "
        "| mp/pb |",
        "|" + "---|" * 14,
    ]
    relays = [
        "| relay | q row ids | sessions | bytes pb | bytes mp | untouched pb | untouched mp "
        "| via tensors pb | via tensors mp | untouched per entry pb | untouched per entry mp |",
        "|" + "---|" * 11,
    ]
    for case in result["cases"]:
        n, size = case["sessions"], case["bytes"]
        t = {
            op: {name: timing[clock]["median_us"] for name, timing in by_codec.items()}
            for op, by_codec in case["timings"].items()
        }
        head = f"| {case['frame']} | {case['q_row_ids']} | {n} | {size[pb]} | {size[mp]}"
        if case["frame"] == "relay":
            raw, full = t["untouched"], t["via_tensors"]
            relays.append(
                f"{head} | {_us(raw[pb])} | {_us(raw[mp])} | {_us(full[pb])} | {_us(full[mp])} "
                f"| {_us(raw[pb] / n)} | {_us(raw[mp] / n)} |"
            )
            continue
        trip = t["round_trip"]
        lines.append(
            f"{head} | {_us(t['encode'][pb])} | {_us(t['encode'][mp])} "
            f"| {_us(t['decode'][pb])} | {_us(t['decode'][mp])} "
            f"| {_us(trip[pb])} | {_us(trip[mp])} | {_us(trip[pb] / n)} | {_us(trip[mp] / n)} "
            f"| {figure(trip[mp] / trip[pb], 2)} |"
        )
    return "\n".join([*lines, "", *relays])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.frame_codec", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--sessions", type=int, nargs="+", default=list(SESSIONS))
    parser.add_argument("--vocab", type=int, default=VOCAB, help="ids in a dense q row")
    parser.add_argument("--top", type=int, default=TOP, help="ids in a sparse q row")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed runs a median takes")
    parser.add_argument("--target-ms", type=float, default=TARGET_MS, help="length of a timed run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.target_ms <= 0 or not 0 < args.top < args.vocab:
        parser.error("need --repeats >= 1, --target-ms > 0 and 0 < --top < --vocab")
    result = run(args.sessions, args.vocab, args.top, args.repeats, args.target_ms, args.seed)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    for clock in CLOCKS:
        print(f"Medians in microseconds, {clock} time ({CLOCKS_SAID[clock]}):\n")
        print(format_table(result, clock) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
