"""The disaggregated service on a real local Ray cluster, started as a user starts it.

The session's one service (`service`, tests/cluster/conftest.py): `tandem serve --preset tiny
--drafters 2 --verifiers 2 --detach` in its own TANDEM_HOME and on free ports. Requests go
through its default door, the Router replicas' own gRPC server, and blocks over direct gRPC to
the drafter and verifier replicas. Replica session counts are read straight from the replicas'
Stats RPC (exact, no heartbeat lag), at the addresses `tandem status --json` reports, with
the cluster secret `tandem serve` settled in the service's home.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.api.client import TandemClient
from cluster.api.client_types import TandemClientError
from cluster.local import LocalTandem
from cluster.routing.grpc_drafter import GrpcDrafter
from cluster.routing.grpc_verifier import GrpcVerifier
from cluster.routing.request import GenerationRequest
from cluster.routing.waits import run
from cluster.runtime.errors import ClusterSecretError
from cluster.serve.ray_cluster import cluster_processes
from cluster.tools.demo import format_report, run_demo
from tests.cluster.conftest import (
    MAX_TOKENS,
    TANDEM,
    TENANT_KEYS,
    live_replicas,
    replica_sessions,
    wait_until_no_sessions,
)
from tests.conftest import PROMPTS

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def expected(local_tandem: LocalTandem) -> dict[str, tuple[int, ...]]:
    """Greedy target-only output per prompt, in-process."""
    out = {}
    for prompt in PROMPTS:
        ids = tuple(local_tandem.tokenizer.encode(prompt, add_special_tokens=False))
        request = GenerationRequest(ids, MAX_TOKENS, draft_tokens=0)
        out[prompt] = local_tandem.router.generate(request).tokens
    return out


def test_deployments_and_replicas(service: dict[str, object]) -> None:
    status = service["status"]
    assert status["status"] == "RUNNING"  # type: ignore[index]
    # `tandem status` names both doors: the routers' own servers first, then Serve's proxies.
    doors = ("address", "http_address", "proxy_address", "proxy_http_address")
    assert [status[door] for door in doors] == [  # type: ignore[index]
        service["address"], service["http_url"],
        service["proxy_address"], service["proxy_http_url"],
    ]  # fmt: skip
    deployments = {"Drafter", "Verifier", "Router", "SuffixDrafter"}
    assert status["deployments"].keys() == deployments  # type: ignore[index]
    for deployment in status["deployments"].values():  # type: ignore[index]
        assert deployment["status"] == "HEALTHY"
    sides = [r["side"] for r in status["replicas"]]  # type: ignore[index]
    assert sides.count("drafter") == 2 and sides.count("verifier") == 2
    assert sides.count("suffix") == 1
    assert all(r["address"].startswith("127.0.0.1:") for r in status["replicas"])  # type: ignore[index]
    # Where Ray placed each: the one node of this cluster, and no resources asked for (the
    # default groups reserve no CPUs and name no node type).
    nodes = {r["node_id"] for r in status["replicas"]}  # type: ignore[index]
    assert len(nodes) == 1 and re.fullmatch(r"[0-9a-f]{56}", nodes.pop())
    assert all(r["resources"] == {} for r in status["replicas"])  # type: ignore[index]
    for replica in status["replicas"]:  # type: ignore[index]
        if replica["side"] == "suffix":  # no model, no engine: its indexes' figures instead
            assert replica["engine"] is None and replica["index_bytes"] >= 0
            continue
        engine = replica["engine"]  # every model replica runs a batching engine
        assert {"steps", "max_batch_sequences", "kv_blocks_total", "kv_blocks_used"} <= set(engine)
        assert 0 <= engine["kv_blocks_used"] <= engine["kv_blocks_total"]
    print(f"cold start of tandem serve: {service['cold_start_s']:.1f} s")


def test_replicas_refuse_calls_without_the_cluster_secret(service: dict[str, object]) -> None:
    secret_file = Path(str(service["home"])) / "cluster_secret"
    assert secret_file.stat().st_mode & 0o777 == 0o600
    for replica in service["status"]["replicas"]:  # type: ignore[index]
        kind = GrpcVerifier if replica["side"] == "verifier" else GrpcDrafter
        for secret in (None, "x" * len(str(service["secret"]))):
            with kind(replica["address"], timeout_s=10, secret=secret) as port:
                with pytest.raises(ClusterSecretError):
                    port.stats()
                with pytest.raises(ClusterSecretError):  # the Frames stream, as sessions go
                    run(port.close_session("anyone's"))


def test_replicas_run_at_normal_priority(service: dict[str, object]) -> None:
    """Ray starts workers at niceness 15; Tandem's cluster runs them at 0 (the replicas are
    the workload, see `ray_cluster.WORKER_NICENESS`)."""
    home = service["home"]
    assert isinstance(home, Path)
    replicas = [
        pid
        for pid in cluster_processes(str(home / "ray"))
        if b"ServeReplica" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(replicas) >= 4  # router(s), 2 drafters, 2 verifiers
    assert {os.getpriority(os.PRIO_PROCESS, pid) for pid in replicas} == {0}


@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
@pytest.mark.parametrize("draft_tokens", range(1, 9))
def test_greedy_through_the_service_is_exact(
    client: TandemClient, expected: dict[str, tuple[int, ...]], draft_tokens: int, pipelined: bool
) -> None:
    for prompt in PROMPTS[:3]:
        result = client.generate(
            prompt, max_tokens=MAX_TOKENS, draft_tokens=draft_tokens, pipelined=pipelined
        )
        assert result.tokens == expected[prompt], prompt
        if pipelined and draft_tokens <= 4:  # a round after a suffix block is serial
            assert result.pipeline_hits + result.pipeline_misses + result.suffix_drafted > 0


def test_target_only_through_the_service(
    client: TandemClient, expected: dict[str, tuple[int, ...]]
) -> None:
    result = client.generate(PROMPTS[0], max_tokens=MAX_TOKENS, draft_tokens=0)
    assert result.tokens == expected[PROMPTS[0]]
    assert result.num_drafted == 0 and result.num_verify_passes == MAX_TOKENS


def test_stream_yields_exactly_what_generate_returns(client: TandemClient) -> None:
    kwargs = dict(max_tokens=40, temperature=0.9, top_p=0.95, seed=11, draft_tokens=3)
    unary = client.generate(PROMPTS[3], **kwargs)  # type: ignore[arg-type]
    chunks = list(client.stream(PROMPTS[3], **kwargs))  # type: ignore[arg-type]
    assert tuple(t for c in chunks for t in c.tokens) == unary.tokens
    assert "".join(c.text for c in chunks) == unary.text
    assert chunks[-1].finish_reason == unary.finish_reason
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_concurrent_clients_are_exact_and_spread(
    service: dict[str, object], client: TandemClient, expected: dict[str, tuple[int, ...]]
) -> None:
    """8 clients at once over 2 drafters, 2 verifiers and a suffix drafter: every output
    exact, and every replica holds sessions while they run."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    seen: dict[str, int] = {}
    running = threading.Event()
    running.set()

    def watch() -> None:
        while running.is_set():
            for replica, n in replica_sessions(service).items():
                seen[replica] = max(seen.get(replica, 0), n)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(
                pool.map(
                    lambda p: client.generate(p, max_tokens=MAX_TOKENS, draft_tokens=4), prompts
                )
            )
    finally:
        running.clear()
        watcher.join()
    for prompt, result in zip(prompts, results, strict=True):
        assert result.tokens == expected[prompt], prompt
    assert len(seen) == 5 and all(n > 0 for n in seen.values()), seen
    assert not any(wait_until_no_sessions(service).values())


def test_cancelling_a_stream_frees_both_replicas(
    service: dict[str, object], client: TandemClient
) -> None:
    stream = client.stream(PROMPTS[0], max_tokens=2000, draft_tokens=4)
    next(stream)
    next(stream)
    during = replica_sessions(service)
    # One drafter session and one verifier session, and at most one suffix drafter session
    # (opened at its first ask, after the opening round).
    sides = {replica["replica_id"]: replica["side"] for replica in service["status"]["replicas"]}  # type: ignore[index]
    model_sessions = {id_: n for id_, n in during.items() if sides[id_] != "suffix"}
    assert sum(model_sessions.values()) == 2
    assert sum(during.values()) - 2 <= 1
    stream.close()  # cancels the call
    after = wait_until_no_sessions(service)
    assert not any(after.values()), after


def test_deadline_frees_both_replicas(service: dict[str, object], client: TandemClient) -> None:
    with pytest.raises(TandemClientError) as error:
        client.generate(PROMPTS[0], max_tokens=4000, timeout_s=0.5)
    assert error.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert not any(wait_until_no_sessions(service).values())


def test_bad_input_gets_invalid_argument(client: TandemClient) -> None:
    for kwargs in (dict(max_tokens=0), dict(max_tokens=5, temperature=float("nan"))):
        with pytest.raises(TandemClientError) as error:
            client.generate("hello", **kwargs)  # type: ignore[arg-type]
        assert error.value.code is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(TandemClientError) as error:
        client.generate([1, 300], max_tokens=4)
    assert error.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the vocabulary" in error.value.message


def test_health_and_reflection(service: dict[str, object]) -> None:
    with grpc.insecure_channel(str(service["address"])) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=30
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as anonymous:  # reflection takes a key, as calls do
            next(iter(stub.ServerReflectionInfo(iter([request]), timeout=30)))
        assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
        key = (("authorization", f"Bearer {TENANT_KEYS['main']}"),)
        response = next(iter(stub.ServerReflectionInfo(iter([request]), metadata=key, timeout=30)))
        names = {s.name for s in response.list_services_response.service}
        assert {"tandem.v1.Tandem", "grpc.health.v1.Health"} <= names


def test_cli_generate_against_the_service(service: dict[str, object]) -> None:
    result = subprocess.run(
        [TANDEM, "generate", "--address", str(service["address"]), "--json",
         "--max-tokens", "16", "def add(a, b):"],
        capture_output=True, text=True, timeout=120, check=False, env=service["env"],  # type: ignore[arg-type]
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert len(out["tokens"]) == 16 and out["num_verify_passes"] > 0


def test_demo_streams_and_compares_with_the_target_alone(
    client: TandemClient, expected: dict[str, tuple[int, ...]]
) -> None:
    written: list[str] = []
    report = run_demo(client, PROMPTS[0], MAX_TOKENS, written.append)
    assert report.same_tokens  # fp32 tiny pair: greedy speculation is exact
    assert report.stats.num_generated_tokens == len(expected[PROMPTS[0]])
    assert report.num_target_only_tokens == len(expected[PROMPTS[0]])
    assert "".join(written) == client.generate(PROMPTS[0], max_tokens=MAX_TOKENS).text
    assert report.stats.num_drafted > 0 and 0.0 <= report.acceptance_rate <= 1.0  # type: ignore[operator]
    assert report.speculative_s > 0 and report.target_only_s > 0
    text = format_report(report)
    assert "speedup over target-only" in text and "same tokens as the target alone: yes" in text


def test_cli_demo_against_the_service(service: dict[str, object]) -> None:
    result = subprocess.run(
        [TANDEM, "demo", "--address", str(service["address"]), "--max-tokens", "16"],
        capture_output=True, text=True, timeout=120, check=False, env=service["env"],  # type: ignore[arg-type]
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def fibonacci(n):")
    assert "acceptance" in result.stdout and "speedup over target-only" in result.stdout


def test_loadtest_compares_speculation_with_the_target_alone(
    service: dict[str, object], tmp_path: Path
) -> None:
    out, chart = tmp_path / "load.json", tmp_path / "load.png"
    result = subprocess.run(
        [TANDEM, "loadtest", "--address", str(service["address"]), "--concurrency", "1", "3",
         "--duration", "2", "--max-tokens", "8", "--temperature", "0.8", "--compare",
         "--json", str(out), "--plot", str(chart)],
        capture_output=True, text=True, timeout=180, check=False, env=service["env"],  # type: ignore[arg-type]
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["config"]["temperature"] == 0.8  # sampled requests, through the service
    levels = report["levels"]
    assert [level["concurrency"] for level in levels] == [1, 3]
    for level in levels:
        for mode in ("speculative", "target_only"):
            assert level[mode]["errors"] == {} and level[mode]["requests"] > 0
            assert 0 < level[mode]["tokens"] <= 8 * level[mode]["requests"]
        assert level["speedup"] > 0
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# Last in this module: they kill replica processes (Serve starts new ones).

KILL_TOKENS = 400


def sessions_on(service: dict[str, object], replica: dict[str, object]) -> int:
    kind = GrpcVerifier if replica["side"] == "verifier" else GrpcDrafter
    with kind(str(replica["address"]), timeout_s=10, secret=str(service["secret"])) as port:
        return port.stats().num_sessions


@pytest.mark.parametrize("side", ["drafter", "verifier"])
def test_killing_a_replica_mid_stream_loses_and_corrupts_nothing(
    service: dict[str, object], client: TandemClient, local_tandem: LocalTandem, side: str
) -> None:
    prompts = list(PROMPTS[:4])
    expected = {}
    for prompt in prompts:
        ids = tuple(local_tandem.tokenizer.encode(prompt, add_special_tokens=False))
        reference = GenerationRequest(ids, KILL_TOKENS, draft_tokens=0)
        expected[prompt] = local_tandem.router.generate(reference).tokens
    candidates = live_replicas(service, side)  # before the streams: it takes a second or two
    streams = [client.stream(p, max_tokens=KILL_TOKENS, draft_tokens=3) for p in prompts]
    received = {p: list(next(stream).tokens) for p, stream in zip(prompts, streams, strict=True)}
    # Every stream is running: kill the replica of `side` that holds the most of them.
    sessions = {str(r["replica_id"]): sessions_on(service, r) for r in candidates}
    busiest = max(candidates, key=lambda r: sessions[str(r["replica_id"])])
    os.kill(int(str(busiest["pid"])), signal.SIGKILL)
    assert sessions[str(busiest["replica_id"])] > 0
    for prompt, stream in zip(prompts, streams, strict=True):
        for chunk in stream:  # a lost request would raise here
            received[prompt].extend(chunk.tokens)
    for prompt in prompts:
        assert tuple(received[prompt]) == expected[prompt], prompt  # nothing corrupted
    # Serve replaces the killed replica; nothing is left open on the live ones.
    wait_until_replaced(service, side, str(busiest["replica_id"]))
    for each_side in ("drafter", "verifier"):
        for replica in live_replicas(service, each_side):
            assert sessions_on(service, replica) == 0


def wait_until_replaced(service: dict[str, object], side: str, killed: str) -> None:
    """Until Serve has started a replica in place of `killed` and the registry has dropped it."""
    deadline = time.monotonic() + 180
    while True:
        live = live_replicas(service, side)
        if len(live) >= 2 and all(r["replica_id"] != killed for r in live):
            return
        assert time.monotonic() < deadline, f"{side} {killed} was not replaced"
        time.sleep(1)


@pytest.mark.parametrize("side", ["drafter", "verifier"])
def test_loadtest_kill_reports_nothing_lost_or_corrupted(
    service: dict[str, object], tmp_path: Path, side: str
) -> None:
    """A replica killed half way through 16 streams on frames (many sessions' entries on each
    stream, the killed one's streams failing every entry at once): every request fails over
    and finishes exact."""
    out = tmp_path / "kill.json"
    result = subprocess.run(
        [TANDEM, "loadtest", "--address", str(service["address"]), "--concurrency", "16",
         "--duration", "8", "--max-tokens", "48", "--draft-tokens", "3", "--kill", side,
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False, env=service["env"],  # type: ignore[arg-type]
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    killed = report["killed"]
    assert len(killed) == 1 and killed[0]["side"] == side and "replica_id" in killed[0]
    assert report["levels"][0]["speculative"]["requests"] > 0
    assert report["lost"] == 0 and report["corrupted"] == 0
    before, after = report["memory"]["before"], report["memory"]["after"]
    assert before[side]["replicas"] >= 2 and after["verifier"]["sessions"] == 0
    assert after["drafter"]["sessions"] == 0 and after["verifier"]["cached_tokens"] == 0
    wait_until_replaced(service, side, killed[0]["replica_id"])


@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
def test_the_suffix_drafter_through_the_service_is_exact_and_drafts(
    service: dict[str, object],
    client: TandemClient,
    expected: dict[str, tuple[int, ...]],
    pipelined: bool,
) -> None:
    """The second time a tenant sends a prompt, its first answer is in the tenant's index on
    the CPU-only suffix replica: blocks from there are verified, and the output is still the
    target's alone. The replica's heartbeat counts its proposals (its metrics)."""
    prompt = PROMPTS[1]
    results = [
        client.generate(prompt, max_tokens=MAX_TOKENS, draft_tokens=4, pipelined=pipelined)
        for _ in range(2)
    ]
    assert [result.tokens for result in results] == [expected[prompt]] * 2
    assert results[1].suffix_accepted > MAX_TOKENS // 4
    assert results[1].suffix_accepted <= results[1].suffix_drafted
    (suffix,) = live_replicas(service, "suffix")
    assert suffix["resources"] == {}  # asked Ray for no GPU (nor anything else)
    assert 0 < suffix["index_proposed"] <= suffix["index_proposals"]  # type: ignore[operator]
    assert suffix["index_bytes"] > 0  # type: ignore[operator]
