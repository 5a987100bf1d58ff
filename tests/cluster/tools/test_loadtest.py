"""The load loop over a scripted client: counts, latencies, errors by code, and its bounds;
and the CPU per token by process role that `tandem loadtest` adds to each run."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from cluster.api.client_types import RequestStats, StreamChunk, TandemClientError
from cluster.cli.loadtest_levels import cpu_scope
from cluster.cli.main import main
from cluster.serve import ray_cluster
from cluster.tools.bench.loadtest import run_load

CHUNK_GAP_S = 0.01


class ScriptedClient:
    """Streams two chunks (1 token, then 3) per request; prompt "bad" fails at once."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    async def stream(self, prompt: str, **settings: Any) -> AsyncIterator[StreamChunk]:
        self.calls.append(settings)
        if prompt == "bad":
            raise TandemClientError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
        await asyncio.sleep(CHUNK_GAP_S)
        yield StreamChunk("r", (1,), "a")
        await asyncio.sleep(CHUNK_GAP_S)
        yield StreamChunk("r", (2, 3, 4), "bcd", "length")


def test_counts_tokens_latencies_and_errors() -> None:
    client = ScriptedClient()
    load = run_load(client, ["ok", "bad"], concurrency=2, duration_s=0.3, settings={"x": 1})
    result = asyncio.run(load)
    assert all(call == {"x": 1} for call in client.calls)
    # Every call either finished or failed with its code.
    assert result["requests"] + result["errors"]["RESOURCE_EXHAUSTED"] == len(client.calls)
    assert result["tokens"] == 4 * result["requests"] > 0
    # The first token arrives after one gap; the next three share the second gap (a sleep
    # lasts at least its time: exact values are checked on a virtual clock below).
    assert result["ttft_ms"]["p50"] >= 1000 * CHUNK_GAP_S
    assert result["itl_ms"]["p50"] >= 1000 * CHUNK_GAP_S / 3
    # Requests start only before the deadline: a worker's successful requests last at least
    # two gaps each, so each of the two starts at most 0.3 / (2 gaps) + 1 of them.
    assert result["requests"] <= 2 * (0.3 / (2 * CHUNK_GAP_S) + 1)


class DraftingClient:
    """Four tokens per request; the last chunk's stats say whether the request drafted:
    prompt "draft" drafted 6 tokens (3 accepted, 1 of them by the suffix drafter) in 2 passes,
    any other prompt drafted nothing in 4 passes."""

    async def stream(self, prompt: str, **settings: Any) -> AsyncIterator[StreamChunk]:
        drafted = prompt == "draft"
        stats = RequestStats(
            num_prompt_tokens=3,
            num_generated_tokens=4,
            num_drafted=6 if drafted else 0,
            num_accepted=3 if drafted else 0,
            num_verify_passes=2 if drafted else 4,
            pipeline_hits=0,
            pipeline_misses=0,
            suffix_drafted=1 if drafted else 0,
        )
        await asyncio.sleep(0)
        yield StreamChunk("r", (1, 2, 3, 4), "abcd", "length", stats)


def test_the_run_sums_what_its_requests_speculated() -> None:
    load = run_load(DraftingClient(), ["draft", "plain"], concurrency=1, duration_s=0.05,
                    settings={})  # fmt: skip
    result = asyncio.run(load)
    drafting = (result["requests"] + 1) // 2  # prompts alternate, "draft" first
    summary = result["speculation"]
    assert summary["num_drafted"] == 6 * drafting
    assert summary["suffix_drafted"] == drafting
    assert summary["num_verify_passes"] == 2 * drafting + 4 * (result["requests"] - drafting)
    assert summary["drafted_per_token"] == pytest.approx(6 * drafting / result["tokens"])
    assert summary["acceptance"] == pytest.approx(0.5)
    assert summary["requests_drafted"] == pytest.approx(drafting / result["requests"])


def test_streams_spread_over_a_list_of_clients() -> None:
    clients = [ScriptedClient() for _ in range(3)]
    result = asyncio.run(run_load(clients, ["ok"], concurrency=6, duration_s=0.2, settings={}))
    assert result["requests"] == sum(len(c.calls) for c in clients)
    assert all(len(c.calls) > 0 for c in clients)  # two streams each


class VirtualClock:
    """Seconds that pass only when the scripted stream below says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedScript:
    """One token after 0.5 s, then three more 0.75 s later: a request lasts 1.25 s."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock

    async def stream(self, prompt: str, **settings: Any) -> AsyncIterator[StreamChunk]:
        self.clock.now += 0.5
        yield StreamChunk("r", (1,), "a")
        self.clock.now += 0.75
        yield StreamChunk("r", (2, 3, 4), "bcd", "length")


def test_latencies_and_the_deadline_on_a_virtual_clock() -> None:
    clock = VirtualClock()
    result = asyncio.run(
        run_load(TimedScript(clock), ["p"], 1, duration_s=5.0, settings={}, clock=clock)
    )
    # Requests start at 0, 1.25, 2.5 and 3.75 s; at 5 s the deadline has passed.
    assert result["requests"] == 4 and result["tokens"] == 16
    assert result["seconds"] == 5.0 and result["tokens_per_s"] == 16 / 5.0
    assert result["ttft_ms"] == {"p50": 500.0, "p99": 500.0}
    # A chunk's gap is split evenly over its tokens: 750 ms over three.
    assert result["itl_ms"] == {"p50": 250.0, "p99": 250.0}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--concurrency", "0"], "--concurrency must be in 1..256"),
        (["--duration", "0"], "--duration must be in"),
        (["--plot", "x.png"], "--plot needs --compare"),
        (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
        (["--hf-baseline"], "--hf-baseline needs --compare"),
        (["--compare", "--hf-baseline", "--temperature", "1"], "measures greedy decoding"),
        (["--preset", "tiny", "--hf-threads", "2"], "--hf-threads needs --hf-baseline"),
        (["--preset", "nope"], "unknown preset 'nope'"),
        (
            ["--compare", "--hf-baseline", "--preset", "sim-h100-8b"],
            "--hf-baseline does not apply to the simulated preset sim-h100-8b",
        ),
        (["--hf-baseline", "--preset", "sim-instant"], "does not apply to the simulated preset"),
        (["--compare", "--hf-baseline", "--hf-threads", "0"], "--hf-threads must be >= 1"),
    ],
)
def test_bad_flags(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["loadtest", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_cpu_scope_is_the_cluster_of_the_service_started_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ray_cluster.HOME_ENV, str(tmp_path))
    assert "every process of uid" in cpu_scope("127.0.0.1:9000").description  # none recorded
    temp_dir = str(tmp_path / "ray")
    ray_cluster.save_state(ray_cluster.ClusterState("127.0.0.1:6379", temp_dir, True, 9000))
    assert temp_dir in cpu_scope("127.0.0.1:9000").description
    # Another port is another service: its processes are found by their titles.
    assert "every process of uid" in cpu_scope("127.0.0.1:9001").description
    # Serve's proxy, the second door, is the same service.
    state = ray_cluster.ClusterState("127.0.0.1:6379", temp_dir, True, 9000, proxy_port=9005)
    ray_cluster.save_state(state)
    assert temp_dir in cpu_scope("127.0.0.1:9005").description
