"""The cluster's shared secret: a replica serves only calls that carry it, so nothing but the
router can drive one; the secret is settled once per application and never shown."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from cluster.config import CLUSTER_SECRET_ENV, TandemConfig
from cluster.local import LocalTandem, text_decoder
from cluster.routing.grpc_drafter import GrpcDrafter
from cluster.routing.grpc_verifier import GrpcVerifier
from cluster.routing.request import GenerationRequest
from cluster.routing.router import Router
from cluster.routing.waits import run
from cluster.runtime.errors import ClusterSecretError, InvalidArgumentError
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling_params import SamplingParams
from drafter.drafter import Drafter
from protos import replica_pb2
from tests.conftest import encode
from tests.replicas import RawStream, frame, serve_drafter, serve_verifier
from verifier.verifier import Verifier

SECRET = "0123456789abcdef" * 2


@pytest.fixture(scope="module")
def guarded(tiny_target: LoadedModel, tiny_draft: LoadedModel) -> Iterator[tuple[str, str]]:
    """Addresses of a drafter and a verifier server that demand SECRET."""
    drafter_server, drafter_port = serve_drafter(Drafter(tiny_draft), secret=SECRET)
    verifier_server, verifier_port = serve_verifier(Verifier(tiny_target), secret=SECRET)
    yield f"127.0.0.1:{drafter_port}", f"127.0.0.1:{verifier_port}"
    drafter_server.stop(None)
    verifier_server.stop(None)


@pytest.mark.parametrize("secret", [None, "wrong-secret-of-32-characters-xx", SECRET[:-1]])
def test_calls_without_the_secret_are_refused(guarded: tuple[str, str], secret: str | None) -> None:
    drafter_address, verifier_address = guarded
    for client in (
        GrpcDrafter(drafter_address, timeout_s=10.0, secret=secret),
        GrpcVerifier(verifier_address, timeout_s=10.0, secret=secret),
    ):
        with client:
            with pytest.raises(ClusterSecretError, match="x-tandem-cluster-secret") as caught:
                run(client.open_session("intruder", [1, 2, 3], SamplingParams(), 0))
            assert "wrong-secret" not in str(caught.value)  # never echoed
            with pytest.raises(ClusterSecretError):
                client.stats()
    with GrpcDrafter(drafter_address, timeout_s=10.0, secret=SECRET) as drafter:
        assert drafter.stats().num_sessions == 0  # nothing was opened


@pytest.mark.parametrize("method", ["Stats", "Reference"])
def test_a_garbage_payload_without_the_secret_is_refused_before_it_is_parsed(
    guarded: tuple[str, str], method: str
) -> None:
    # Parsed, the payload would be INVALID_ARGUMENT (or, for Stats, served): UNAUTHENTICATED
    # says the secret was checked first.
    address = guarded[1] if method == "Reference" else guarded[0]
    service = "Verifier" if method == "Reference" else "Drafter"
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(f"/tandem.v1.{service}/{method}")
        with pytest.raises(grpc.RpcError) as caught:
            call(b"\xff\x00 not a protobuf", timeout=10.0)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("side", [0, 1], ids=["drafter", "verifier"])
def test_a_frames_stream_without_the_secret_is_refused_before_a_frame_is_parsed(
    guarded: tuple[str, str], side: int
) -> None:
    # Every session call travels on the Frames stream: without the secret, the whole stream is
    # refused, whether its frames are garbage or well-formed entries.
    service = ("Drafter", "Verifier")[side]
    with RawStream(guarded[side], service, serialize=lambda raw: raw) as garbage:
        garbage.send(b"\xff\x00 not a protobuf")
        assert garbage.status()[0] == grpc.StatusCode.UNAUTHENTICATED
    with RawStream(guarded[side], service) as stream:
        opening = replica_pb2.OpenSessionRequest(session_id="intruder", prompt_token_ids=[1])
        stream.send(frame(stream.entry("open", opening)))
        code, details = stream.status()
    assert code == grpc.StatusCode.UNAUTHENTICATED and "x-tandem-cluster-secret" in details
    assert stream.unread() == []  # no entry was answered


def test_a_router_that_carries_the_secret_generates_exactly(
    guarded: tuple[str, str],
    local_tandem: LocalTandem,
    target_only: dict[str, tuple[int, ...]],
    tiny_target: LoadedModel,
) -> None:
    drafter = GrpcDrafter(guarded[0], timeout_s=30.0, secret=SECRET)
    verifier = GrpcVerifier(guarded[1], timeout_s=30.0, secret=SECRET)
    router = Router(
        verifier, drafter, text_decoder(tiny_target.tokenizer), tiny_target.eos_token_ids
    )
    try:
        prompt, expected = next(iter(target_only.items()))
        request = GenerationRequest(encode(local_tandem, prompt), len(expected), draft_tokens=3)
        assert router.generate(request).tokens == expected
        assert drafter.stats().num_sessions == verifier.stats().num_sessions == 0
    finally:
        router.close()
        drafter.close()
        verifier.close()


def test_the_secret_is_settled_once_from_config_then_environment_else_made_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(CLUSTER_SECRET_ENV, raising=False)
    made_up = TandemConfig().with_cluster_secret()
    assert made_up.cluster_secret and len(made_up.cluster_secret) >= 32
    assert made_up.with_cluster_secret() is made_up  # settled once, kept after
    assert TandemConfig().with_cluster_secret().cluster_secret != made_up.cluster_secret
    monkeypatch.setenv(CLUSTER_SECRET_ENV, SECRET)
    assert TandemConfig().with_cluster_secret().cluster_secret == SECRET
    own = TandemConfig(cluster_secret="from-the-config-file-0123")
    assert own.with_cluster_secret().cluster_secret == "from-the-config-file-0123"
    assert "from-the-config" not in repr(own)  # never in a log line
    with pytest.raises(InvalidArgumentError, match="cluster_secret"):
        TandemConfig(cluster_secret="short")
