"""The load loop over a scripted client: counts, latencies, errors by code, and its bounds."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from cluster.api.client_types import StreamChunk, TandemClientError
from cluster.cli.main import main
from cluster.tools.loadtest import run_load

CHUNK_GAP_S = 0.01


class ScriptedClient:
    """Streams two chunks (1 token, then 3) per request; prompt "bad" fails at once."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def stream(self, prompt: str, **settings: Any) -> Iterator[StreamChunk]:
        self.calls.append(settings)
        if prompt == "bad":
            raise TandemClientError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
        time.sleep(CHUNK_GAP_S)
        yield StreamChunk("r", (1,), "a")
        time.sleep(CHUNK_GAP_S)
        yield StreamChunk("r", (2, 3, 4), "bcd", "length")


def test_counts_tokens_latencies_and_errors() -> None:
    client = ScriptedClient()
    result = run_load(client, ["ok", "bad"], concurrency=2, duration_s=0.3, settings={"x": 1})
    assert all(call == {"x": 1} for call in client.calls)
    # Every call either finished or failed with its code.
    assert result["requests"] + result["errors"]["RESOURCE_EXHAUSTED"] == len(client.calls)
    assert result["tokens"] == 4 * result["requests"] > 0
    # The first token arrives after one gap; the next three share the second gap.
    assert result["ttft_ms"]["p50"] >= 1000 * CHUNK_GAP_S
    assert 1000 * CHUNK_GAP_S / 3 <= result["itl_ms"]["p50"] < 1000 * CHUNK_GAP_S
    # Requests start only before the deadline, and in-flight ones finish.
    assert result["seconds"] < 0.3 + 1.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--concurrency", "0"], "--concurrency must be in 1..256"),
        (["--duration", "0"], "--duration must be in"),
        (["--plot", "x.png"], "--plot needs --compare"),
        (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    ],
)
def test_bad_flags(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["loadtest", *argv]) == 2
    assert message in capsys.readouterr().err
