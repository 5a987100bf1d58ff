"""`tandem serve`'s two doors, without a cluster: the routers' own servers (`--port`,
`--http-port`: the default door) and Serve's proxies (`--proxy-port`, `--proxy-http-port`: the
second), how each port is chosen from the flags and the config, the checks that they are free,
the lines printed, and how `cluster.json` records them."""

from __future__ import annotations

import argparse
import json
import socket
from pathlib import Path

import pytest

from cluster.cli import service as cli_service
from cluster.cli.doors import PORT_FLAGS, door_lines, proxy_http_port
from cluster.cli.serve_flags import config_from_flags
from cluster.runtime.errors import InvalidArgumentError
from cluster.serve import loopback, ray_cluster
from cluster.serve.loopback import LOOPBACK
from cluster.serve.ray_cluster import ClusterState, cluster_ports


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli_service.add_to(parser.add_subparsers())
    return parser.parse_args(["serve", *flags])


def doors(*flags: str) -> tuple[int | None, int | None, int, int]:
    """(routers' gRPC, routers' HTTP, Serve's gRPC proxy, Serve's HTTP proxy) of `flags`."""
    args = parse(*flags)
    config = config_from_flags(args)
    assert config.front.host == LOOPBACK  # `tandem serve` serves this machine only
    return (
        config.front.grpc_port,
        config.front.http_port,
        config.proxy_grpc_port,
        proxy_http_port(args, config),
    )


def test_the_help_names_the_four_ports_and_no_direct_port(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse("--help")
    text = " ".join(capsys.readouterr().out.split())
    for flag in PORT_FLAGS:
        assert f"{flag} PORT" in text
    assert "served by the router replicas themselves (default 9000" in text
    assert "Serve's HTTP proxy" in text and "(default: the HTTP port + 1)" in text
    assert "--direct-port" not in text and "--direct-http-port" not in text


def test_the_default_door_is_9000_and_8000_and_the_proxies_one_above() -> None:
    assert doors() == (9000, 8000, 9001, 8001)
    assert doors("--port", "9100", "--http-port", "8100") == (9100, 8100, 9101, 8101)
    assert doors("--proxy-port", "9500", "--proxy-http-port", "8500") == (9000, 8000, 9500, 8500)


def test_a_config_file_sets_the_ports_the_flags_do_not(tmp_path: Path) -> None:
    config = tmp_path / "tandem.yaml"
    config.write_text("front: {grpc_port: 9200, http_port: 8200}\n")
    assert doors("--config", str(config)) == (9200, 8200, 9201, 8201)
    assert doors("--config", str(config), "--port", "9100") == (9100, 8200, 9101, 8201)
    config.write_text("proxy_grpc_port: 9300\n")  # its own proxy port wins over --port + 1
    assert doors("--config", str(config), "--port", "9100") == (9100, 8000, 9300, 8001)
    config.write_text("front: {grpc_port: null, http_port: null}\n")  # no front: proxies only
    assert doors("--config", str(config)) == (None, None, 9001, 8001)


@pytest.mark.parametrize("value", ["0", "65536", "x"])
def test_a_port_flag_takes_port_numbers_only(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse("--proxy-port", value)
    assert f"argument --proxy-port: {value!r} is not a port (1..65535)" in capsys.readouterr().err


def test_a_port_in_use_or_given_twice_is_refused_naming_its_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ray_cluster.HOME_ENV, str(tmp_path))
    ports = loopback.free_door_ports()
    with socket.socket() as held:
        held.bind((LOOPBACK, ports["--proxy-http-port"]))
        held.listen()
        for flag in PORT_FLAGS:
            args = parse(*loopback.port_arguments(ports))
            if flag != "--proxy-http-port":
                with socket.socket() as other:  # this one held too
                    other.bind((LOOPBACK, ports[flag]))
                    other.listen()
                    with pytest.raises(InvalidArgumentError, match=rf"another with {flag}$"):
                        cli_service.serve_command(args)
        args = parse(*loopback.port_arguments(ports))
        with pytest.raises(InvalidArgumentError, match=r"another with --proxy-http-port$"):
            cli_service.serve_command(args)
    twice = parse(*loopback.port_arguments(ports),
                  "--proxy-port", str(ports["--port"]))  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="--port and --proxy-port are both port"):
        cli_service.serve_command(twice)
    assert ray_cluster.load_state() is None  # refused before any cluster was started


def test_a_tools_service_names_a_free_port_for_each_door() -> None:
    ports = loopback.free_door_ports()
    assert list(ports) == list(PORT_FLAGS) and len(set(ports.values())) == 4
    assert all(loopback.port_is_free(port) for port in ports.values())
    # The proxies' ports are the ones picked, not one above the routers' (free by chance only).
    assert doors(*loopback.port_arguments(ports)) == tuple(ports.values())


def test_a_proxy_port_in_use_on_a_cluster_started_elsewhere_is_refused_before_serve_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cluster `tandem serve` did not start (`make demo-nodes` starts its own nodes) has no
    proxies yet: their ports are checked as a new cluster's are, and the cluster keeps running."""
    _, stopped, args = failing_start(
        tmp_path, monkeypatch, AssertionError("Serve must not start"), running_before=True
    )
    for flag in PORT_FLAGS[2:]:
        with socket.socket() as held:
            held.bind((LOOPBACK, getattr(args, flag.removeprefix("--").replace("-", "_"))))
            held.listen()
            with pytest.raises(InvalidArgumentError, match=rf"another with {flag}$"):
                cli_service.serve_command(args)
    assert stopped == []


def test_serve_prints_the_default_door_first_then_serves_proxies() -> None:
    state = ClusterState(
        "127.0.0.1:6379", "/tmp/x", True, grpc_port=9000, http_port=8000,
        proxy_port=9001, proxy_http_port=8001,
    )  # fmt: skip
    assert door_lines(state) == [
        "gRPC API on 127.0.0.1:9000 (tandem.v1.Tandem)",
        "OpenAI-compatible API on http://127.0.0.1:8000/v1",
        "through Serve's proxies: gRPC 127.0.0.1:9001, HTTP http://127.0.0.1:8001/v1",
    ]
    proxies_only = ClusterState("127.0.0.1:6379", "/tmp/x", True, proxy_port=9001,
                                proxy_http_port=8001)  # fmt: skip
    assert door_lines(proxies_only) == [
        "through Serve's proxies: gRPC 127.0.0.1:9001, HTTP http://127.0.0.1:8001/v1",
    ]


def test_a_running_cluster_keeps_its_proxies_ports(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("--proxy-port", "9500", "--proxy-http-port", "8500")
    config = config_from_flags(args)
    running = ClusterState("127.0.0.1:6379", "/tmp/x", True, proxy_port=9001, proxy_http_port=8001)
    kept, http_port = cli_service._kept_proxies(config, 8500, running)
    assert (kept.proxy_grpc_port, http_port) == (9001, 8001)
    assert "keeps Serve's proxies on ports 9001 (gRPC) and 8001 (HTTP)" in capsys.readouterr().err
    # A cluster whose proxies never started takes the ports asked for.
    fresh = ClusterState("127.0.0.1:6379", "/tmp/x", True)
    kept, http_port = cli_service._kept_proxies(config, 8500, fresh)
    assert (kept.proxy_grpc_port, http_port) == (9500, 8500)
    assert capsys.readouterr().err == ""


def test_the_state_records_both_doors_and_reads_an_older_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ray_cluster.HOME_ENV, str(tmp_path))
    state = ClusterState(
        "127.0.0.1:6379", "/tmp/x", True, grpc_port=9000, http_port=8000,
        proxy_port=9001, proxy_http_port=8001, metrics_port=7000,
    )  # fmt: skip
    assert sorted(cluster_ports(state)) == [6379, 7000, 8000, 8001, 9000, 9001]
    assert state.serves_grpc_on(9000) and state.serves_grpc_on("9001")
    assert not state.serves_grpc_on(8000) and not state.serves_grpc_on(9002)
    ray_cluster.save_state(state)
    assert ray_cluster.load_state() == state
    # Written when Serve's proxies were the first door and the routers' own the `direct` one.
    old = {"address": "127.0.0.1:6379", "temp_dir": "/tmp/x", "started_by_tandem": True,
           "grpc_port": 9000, "http_port": 8000, "app_name": "tandem",
           "direct_port": 9001, "direct_http_port": 8001}  # fmt: skip
    (tmp_path / "cluster.json").write_text(json.dumps(old))
    read = ray_cluster.load_state()
    assert read is not None
    assert (read.grpc_port, read.http_port, read.proxy_port, read.proxy_http_port) == (
        9001, 8001, 9000, 8000,
    )  # fmt: skip


def test_the_stream_interval_flags_reach_the_api_config() -> None:
    config = config_from_flags(parse("--stream-interval-tokens", "4", "--stream-interval-ms", "50"))
    assert (config.api.stream_interval_tokens, config.api.stream_interval_ms) == (4, 50.0)
    default = config_from_flags(parse())
    assert (default.api.stream_interval_tokens, default.api.stream_interval_ms) == (0, 0.0)


def failing_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception, running_before: bool
) -> tuple[ClusterState, list[ClusterState], argparse.Namespace]:
    """`tandem serve` with no real cluster, whose Serve start raises `error`: the state it
    starts (or finds, `running_before`), the states it stopped, and its arguments."""
    from ray import serve

    monkeypatch.setenv(ray_cluster.HOME_ENV, str(tmp_path))
    state = ClusterState("127.0.0.1:6379", str(tmp_path / "ray"), True)
    stopped: list[ClusterState] = []
    monkeypatch.setattr(ray_cluster, "start_cluster", lambda num_cpus: state)
    monkeypatch.setattr(cli_service, "_live_state", lambda: state if running_before else None)
    monkeypatch.setattr(ray_cluster, "connect", lambda state: None)
    monkeypatch.setattr(ray_cluster, "stop_cluster", lambda state: stopped.append(state) or 7)

    def start(**options: object) -> None:
        raise error

    monkeypatch.setattr(serve, "start", start)
    args = parse(*loopback.port_arguments(loopback.free_door_ports()))
    return state, stopped, args


@pytest.mark.parametrize("running_before", [False, True], ids=["started", "running-before"])
def test_a_failed_start_says_what_failed_in_one_line_and_stops_what_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, running_before: bool
) -> None:
    died = RuntimeError("The proxy actor died unexpectedly\n  File ...\n  raise ...")
    state, stopped, args = failing_start(tmp_path, monkeypatch, died, running_before)
    with pytest.raises(ray_cluster.ClusterError) as failed:
        cli_service.serve_command(args)
    message = str(failed.value)
    assert "\n" not in message
    cause = "starting Serve's proxies failed (RuntimeError: The proxy actor died unexpectedly)"
    assert cause in message
    assert "Ray's logs are in " + str(tmp_path / "ray" / "session_latest" / "logs") in message
    if running_before:  # not this command's to stop
        assert stopped == [] and "keeps running" in message
    else:
        assert stopped == [state] and "it started is stopped (7 processes)" in message


def test_a_failed_ray_task_is_reported_by_its_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ray.exceptions import RayTaskError

    bind = RuntimeError("Failed to bind to address '127.0.0.1:20001'.")
    task = RayTaskError("ready", "Traceback ...", bind, proctitle="ray::ProxyActor.ready()")
    _, _, args = failing_start(tmp_path, monkeypatch, task.as_instanceof_cause(), True)
    with pytest.raises(ray_cluster.ClusterError) as failed:
        cli_service.serve_command(args)
    assert "proxies failed (RuntimeError: Failed to bind to address '127.0.0.1:20001'.)" in str(
        failed.value
    )


def test_a_start_refused_for_its_input_keeps_its_status_and_stops_what_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = InvalidArgumentError("no such model")
    state, stopped, args = failing_start(tmp_path, monkeypatch, bad, running_before=False)
    with pytest.raises(InvalidArgumentError, match="no such model"):
        cli_service.serve_command(args)
    assert stopped == [state]
