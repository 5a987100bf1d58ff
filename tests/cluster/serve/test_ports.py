"""Ports after a cluster stops: free as a server would bind them (closed connections in
TIME_WAIT do not hold them), held while anything listens; `stop_cluster` waits for them."""

from __future__ import annotations

import socket

from cluster.serve.loopback import port_is_free, wait_ports_free
from cluster.serve.ray_cluster import ClusterState, cluster_ports


def listener() -> socket.socket:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", 0))
    server.listen()
    return server


def test_a_listened_port_is_held_until_its_server_closes() -> None:
    server = listener()
    port = server.getsockname()[1]
    assert not port_is_free(port)
    assert wait_ports_free([port], timeout_s=0.2) == [port]
    server.close()
    assert port_is_free(port)
    assert wait_ports_free([port], timeout_s=0.2) == []


def test_a_server_just_closed_with_connections_in_time_wait_leaves_its_port_free() -> None:
    server = listener()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server closes first: its side of the connection is in TIME_WAIT
    client.recv(1)
    client.close()
    server.close()
    plain = socket.socket()
    try:
        plain.bind(("0.0.0.0", port))  # a bind without SO_REUSEADDR may still fail here
    except OSError:
        pass
    finally:
        plain.close()
    assert port_is_free(port)  # but a server (which sets it) can listen again at once


def test_a_clusters_ports_are_its_gcs_apis_and_metrics() -> None:
    state = ClusterState(
        address="10.0.0.5:6379",
        temp_dir="/tmp/x",
        started_by_tandem=True,
        grpc_port=9000,
        http_port=8000,
        metrics_port=None,
    )
    assert sorted(cluster_ports(state)) == [6379, 8000, 9000]
