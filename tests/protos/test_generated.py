"""The generated code matches the .proto files, and the wire types round-trip as designed."""

import shutil
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
from google.protobuf.descriptor import FileDescriptor
from google.protobuf.message import Message

from protos import generate_pb2, replica_pb2, sampling_pb2
from protos.build import GENERATED_PATTERNS, PACKAGE, REPO_ROOT, find_drift
from tests.wire_messages import raw_sparse


def test_checked_in_code_matches_protos() -> None:
    assert find_drift() == []


@pytest.fixture
def repo_copy(tmp_path: Path) -> Path:
    """A copy of the protos package (sources and generated code), to alter without harm."""
    (tmp_path / PACKAGE).mkdir()
    for pattern in ("*.proto", *GENERATED_PATTERNS):
        for path in (REPO_ROOT / PACKAGE).glob(pattern):
            shutil.copyfile(path, tmp_path / PACKAGE / path.name)
    return tmp_path


def test_find_drift_reports_code_stale_after_proto_change(repo_copy: Path) -> None:
    assert find_drift(repo_copy) == []
    proto = repo_copy / PACKAGE / "replica.proto"
    source = proto.read_text()
    changed = source.replace(
        "message StatsRequest {}", "message StatsRequest { bool verbose = 1; }"
    )
    assert changed != source
    proto.write_text(changed)

    # The message descriptor is in _pb2.py and its stub in _pb2.pyi; the services did not change.
    assert find_drift(repo_copy) == [
        "different: protos/replica_pb2.py",
        "different: protos/replica_pb2.pyi",
    ]


def test_find_drift_reports_missing_and_extra_files(repo_copy: Path) -> None:
    (repo_copy / PACKAGE / "sampling_pb2.pyi").unlink()
    (repo_copy / PACKAGE / "removed_pb2.py").write_text("# from a deleted .proto\n")

    assert find_drift(repo_copy) == [
        "extra: protos/removed_pb2.py",
        "missing: protos/sampling_pb2.pyi",
    ]


M = TypeVar("M", bound=Message)


def _round_trip(message: M) -> M:
    """Serialises and parses `message`, checks nothing was lost, and returns the parsed copy."""
    parsed = type(message)()
    parsed.ParseFromString(message.SerializeToString())
    assert parsed == message
    return parsed


def test_generate_request_with_token_ids_round_trips() -> None:
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=[1, 15043, 29892]),
        max_tokens=32,
        sampling=sampling_pb2.SamplingParams(temperature=0.7, top_p=0.9, top_k=50),
        seed=1234,
        stop=["\n\n"],
        speculation=generate_pb2.SpeculationSettings(draft_tokens=4, pipelined=True),
    )
    parsed = _round_trip(request)
    assert parsed.WhichOneof("prompt") == "token_ids"
    assert list(parsed.token_ids.ids) == [1, 15043, 29892]
    assert parsed.HasField("seed") and parsed.seed == 1234


def test_generate_request_with_text_round_trips() -> None:
    request = generate_pb2.GenerateRequest(text="Once upon a time", max_tokens=8)
    parsed = _round_trip(request)
    assert parsed.WhichOneof("prompt") == "text"
    assert parsed.text == "Once upon a time"
    assert not parsed.HasField("seed")
    assert not parsed.HasField("speculation")


def test_prompt_oneof_keeps_only_the_last_set() -> None:
    request = generate_pb2.GenerateRequest(text="hello")
    request.token_ids.ids.append(7)
    assert request.WhichOneof("prompt") == "token_ids"
    assert request.text == ""


def test_optional_fields_tell_unset_from_default() -> None:
    # top_p: unset means 1.0, so an explicit value (even 0.0) must be distinguishable from unset.
    unset = _round_trip(generate_pb2.GenerateRequest(sampling=sampling_pb2.SamplingParams()))
    assert not unset.sampling.HasField("top_p")
    explicit = _round_trip(
        generate_pb2.GenerateRequest(sampling=sampling_pb2.SamplingParams(top_p=0.0))
    )
    assert explicit.sampling.HasField("top_p") and explicit.sampling.top_p == 0.0

    # draft_tokens: unset means the server default, 0 means speculation off.
    default = _round_trip(
        generate_pb2.GenerateRequest(speculation=generate_pb2.SpeculationSettings())
    )
    assert not default.speculation.HasField("draft_tokens")
    assert not default.speculation.HasField("pipelined")
    off = _round_trip(
        generate_pb2.GenerateRequest(
            speculation=generate_pb2.SpeculationSettings(draft_tokens=0, pipelined=False)
        )
    )
    assert off.speculation.HasField("draft_tokens") and off.speculation.draft_tokens == 0
    assert off.speculation.HasField("pipelined") and not off.speculation.pipelined


def test_draft_block_with_sparse_probs_round_trips() -> None:
    # Probabilities are exact in float32 (powers of two), so equality after parsing is exact.
    block = replica_pb2.DraftBlock(
        base_length=17,
        token_ids=[42, 7],
        draft_probs=[
            raw_sparse(token_ids=[42, 3, 9], probs=[0.5, 0.25, 0.25]),
            raw_sparse(token_ids=[7], probs=[1.0]),
        ],
    )
    parsed = _round_trip(block)
    assert parsed.base_length == 17
    assert [np.frombuffer(q.token_ids, "<i4").tolist() for q in parsed.draft_probs] == [
        [42, 3, 9],
        [7],
    ]
    assert [np.frombuffer(q.probs, "<f4").tolist() for q in parsed.draft_probs] == [
        [0.5, 0.25, 0.25],
        [1.0],
    ]

    request = replica_pb2.VerifyRequest(session_id="s-1", block=block)
    assert replica_pb2.VerifyRequest.FromString(request.SerializeToString()) == request


def test_verdict_round_trips() -> None:
    # Two of three draft tokens accepted, then one recovered token: 17 + 3 committed.
    verdict = replica_pb2.Verdict(
        base_length=17, num_accepted=2, token_ids=[42, 7, 99], committed_length=20
    )
    parsed = _round_trip(verdict)
    assert (parsed.base_length, parsed.num_accepted) == (17, 2)
    assert list(parsed.token_ids) == [42, 7, 99]
    assert parsed.committed_length == 20


def test_pipelining_fields_round_trip() -> None:
    # truncate_to: unset means drop nothing, so an explicit 0 must be distinguishable from it.
    unset = _round_trip(replica_pb2.DraftRequest(session_id="s-1", base_length=9, num_tokens=4))
    assert not unset.HasField("truncate_to")
    explicit = _round_trip(replica_pb2.DraftRequest(base_length=9, num_tokens=4, truncate_to=0))
    assert explicit.HasField("truncate_to") and explicit.truncate_to == 0

    request = _round_trip(replica_pb2.VerifyRequest(session_id="s-1", defer_bonus=True))
    assert request.defer_bonus
    assert not replica_pb2.VerifyRequest().defer_bonus

    # All three draft tokens accepted and the bonus deferred: no token of the target's own.
    verdict = _round_trip(
        replica_pb2.Verdict(
            base_length=17,
            num_accepted=3,
            token_ids=[42, 7, 99],
            committed_length=20,
            bonus_deferred=True,
        )
    )
    assert verdict.bonus_deferred
    assert not replica_pb2.Verdict().bonus_deferred


def test_running_session_fields_round_trip() -> None:
    # A running session's open carries where its output ends; a block drafted ahead carries
    # the tokens it assumes; a verdict tells tokens already committed (matched) and a dropped
    # block apart; the engine counts its running sessions.
    opening = _round_trip(
        replica_pb2.OpenSessionRequest(
            session_id="s-1",
            advance=replica_pb2.Advance(max_length=60, end_token_ids=[0, 2], ends_from=21),
        )
    )
    assert opening.HasField("advance")
    assert (opening.advance.max_length, list(opening.advance.end_token_ids)) == (60, [0, 2])
    assert opening.advance.ends_from == 21
    assert not replica_pb2.OpenSessionRequest().HasField("advance")  # unset: lockstep

    block = _round_trip(
        replica_pb2.DraftBlock(base_length=17, token_ids=[42], assumed_token_ids=[5, 6])
    )
    assert list(block.assumed_token_ids) == [5, 6]

    verdict = _round_trip(
        replica_pb2.Verdict(base_length=17, num_matched=2, num_accepted=1, dropped=False)
    )
    assert (verdict.num_matched, verdict.num_accepted, verdict.dropped) == (2, 1, False)
    assert _round_trip(replica_pb2.Verdict(base_length=17, dropped=True)).dropped

    stats = _round_trip(replica_pb2.EngineStats(running_sessions=12, running_stepped=9))
    assert (stats.running_sessions, stats.running_stepped) == (12, 9)


def _method_names(descriptor_file: FileDescriptor, service: str) -> list[str]:
    return [m.name for m in descriptor_file.services_by_name[service].methods]


def test_services_have_expected_methods() -> None:
    assert _method_names(generate_pb2.DESCRIPTOR, "Tandem") == [
        "Generate",
        "GenerateStream",
        "Cancel",
        "GetUsage",
        "Audit",
    ]
    # Every session call travels on the Frames stream: no unary session RPCs are left.
    assert _method_names(replica_pb2.DESCRIPTOR, "Drafter") == ["Stats", "Frames"]
    assert _method_names(replica_pb2.DESCRIPTOR, "Verifier") == ["Stats", "Reference", "Frames"]
    stream = generate_pb2.DESCRIPTOR.services_by_name["Tandem"].methods_by_name["GenerateStream"]
    assert stream.server_streaming and not stream.client_streaming
    for side in ("Drafter", "Verifier"):
        frames = replica_pb2.DESCRIPTOR.services_by_name[side].methods_by_name["Frames"]
        assert frames.server_streaming and frames.client_streaming


def test_all_files_share_one_package() -> None:
    for module in (sampling_pb2, generate_pb2, replica_pb2):
        assert module.DESCRIPTOR.package == "tandem.v1"
