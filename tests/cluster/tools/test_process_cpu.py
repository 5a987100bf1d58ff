"""CPU per process role: /proc parsing, classifying real Ray titles, the window arithmetic on
synthetic snapshots, and reading this process and its children from /proc (no Ray; no timed
assertion: only "some CPU was counted where it was spent")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.tools.bench import process_cpu, process_roles
from cluster.tools.bench.cpu_table import cpu_line, cpu_table
from cluster.tools.bench.cpu_usage import Reading, add_usage, descendants, parse_stat, usage
from cluster.tools.bench.process_cpu import CpuCalls, CpuWindow, Scope, read_snapshot, user_scope
from cluster.tools.bench.process_roles import CLIENT, ROLES, SERVICE_TOTAL, classify, process_name

REPO = Path(__file__).resolve().parents[3]
VENV = "/work/x/.venv/lib/python3.11/site-packages/ray"
NO_SERVICE = Scope("nothing but the load client", lambda parents, cmdlines: set())

# Command lines as /proc shows them for a `tandem serve` (NUL-separated; Ray pads retitled
# workers with spaces), with the role each must get.
CMDLINES = {
    "ray::ServeReplica:tandem:Router" + " " * 40: "router",
    "ray::ServeReplica:tandem:Router.handle_request_streaming": "router",
    "ray::ServeReplica:tandem:Drafter": "drafter",
    "ray::ServeReplica:my.app:Verifier.reconfigure": "verifier",
    "ray::ServeReplica:tandem:SomethingElse": "other",
    "ray::ProxyActor": "proxy",
    "ray::ServeController.listen_for_change": "controller",
    "ray::ReplicaRegistry": "registry",
    "ray::DashboardAgent": "ray",
    "ray::RuntimeEnvAgent": "ray",
    "ray::IDLE": "ray",
    f"{VENV}/core/src/ray/gcs/gcs_server\0--log_dir=/tmp/t/ray/session_1/logs": "ray",
    f"{VENV}/core/src/ray/raylet/raylet\0--raylet_socket_name=/tmp/t/ray/s": "ray",
    f"/x/.venv/bin/python\0{VENV}/dashboard/dashboard.py\0--host=127.0.0.1": "ray",
    f"/x/.venv/bin/python\0-u\0{VENV}/_private/log_monitor.py\0--session-dir=/tmp": "ray",
    f"/x/.venv/bin/python\0-u\0{VENV}/autoscaler/_private/monitor.py\0--logs-dir=/tmp": "ray",
    "/x/.venv/bin/python\0-m\0ray.util.client.server\0--address=127.0.0.1:1": "ray",
}
NOT_RAY = [
    "",
    "bash\0-c\0sleep 1",
    "/x/.venv/bin/python\0-m\0pytest\0-q",
    "/usr/bin/python3\0/home/me/monitor.py",  # a script of the same name, not Ray's
    "vim\0ray::ProxyActor",  # a title only counts as the first word
]


@pytest.mark.parametrize(("cmdline", "role"), CMDLINES.items())
def test_classify_by_title(cmdline: str, role: str) -> None:
    assert classify(cmdline) == role


@pytest.mark.parametrize("cmdline", NOT_RAY)
def test_processes_with_no_role(cmdline: str) -> None:
    assert classify(cmdline) is None


def test_the_roles_name_what_tandem_deploys() -> None:
    """The deployment and actor names the roles go by are those the service uses."""
    app = (REPO / "cluster/serve/app.py").read_text()
    assert all(f'"{name}"' in app for name in process_roles.DEPLOYMENT_ROLES)
    registry = (REPO / "cluster/routing/registry.py").read_text()
    assert "class ReplicaRegistry" in registry


def test_process_names() -> None:
    assert process_name("ray::ServeReplica:tandem:Router.handle_request ") == (
        "ServeReplica:tandem:Router"
    )
    assert process_name("ray::ServeController.listen_for_change") == "ServeController"
    assert process_name(f"{VENV}/core/src/ray/raylet/raylet\0--x=1") == "raylet"
    assert process_name("/x/bin/python\0-u\0/y/log_monitor.py\0--a=b") == "log_monitor.py"
    assert process_name("/x/bin/python3.11\0-m\0ray.util.client.server\0--p=1") == (
        "ray.util.client.server"
    )
    assert process_name("") == "?"


def test_parse_stat_counts_from_the_last_parenthesis() -> None:
    # A command name may hold spaces and ')': pid (comm) state ppid ... utime stime ... start.
    fields = ["S", "41"] + ["0"] * 9 + ["250", "37"] + ["0"] * 6 + ["9001"] + ["0"] * 30
    text = "1234 (ray::ServeRepli) x) " + " ".join(fields)
    assert parse_stat(text) == (41, 287, 9001)


def test_parse_stat_of_this_process() -> None:
    ppid, ticks, start = parse_stat(Path(f"/proc/{os.getpid()}/stat").read_text())
    assert ppid == os.getppid() and ticks >= 0 and start > 0


def test_descendants_follow_the_parent_chain() -> None:
    parents = {1: 0, 10: 1, 11: 10, 12: 11, 20: 1, 21: 20}
    assert descendants(parents, [10]) == {10, 11, 12}
    assert descendants(parents, [20, 12]) == {20, 21, 12}
    assert descendants(parents, []) == set()


def _reading(pid: int, ticks: int, role: str, start: int = 100) -> Reading:
    return Reading(pid, 1, start, ticks, role, f"p{pid}")


def _snapshot(*readings: Reading) -> dict[tuple[int, int], Reading]:
    return {r.key: r for r in readings}


def test_usage_of_a_window() -> None:
    """100 ticks a second; 50 tokens in 2 s. Process by process:
    router 200 -> 400 ticks (2 s); verifier 50 -> 150 (1 s); a drafter that starts in the window
    counts from 0 (0.5 s); one that ends after the middle snapshot counts to its last reading
    (30 -> 80: 0.5 s); pid 7 is reused (another start time): the old one counts to its last
    reading (0 s), the new one from 0 (0.25 s); the client 10 -> 30 (0.2 s)."""
    first = _snapshot(
        _reading(1, 200, "router"), _reading(2, 50, "verifier"), _reading(4, 30, "drafter"),
        _reading(7, 500, "ray"), _reading(9, 10, CLIENT),
    )  # fmt: skip
    middle = _snapshot(
        _reading(1, 300, "router"), _reading(2, 100, "verifier"), _reading(4, 80, "drafter"),
        _reading(9, 20, CLIENT),
    )  # fmt: skip
    last = _snapshot(
        _reading(1, 400, "router"), _reading(2, 150, "verifier"), _reading(3, 50, "drafter"),
        _reading(7, 25, "ray", start=900), _reading(9, 30, CLIENT),
    )  # fmt: skip
    result = usage([first, middle, last], tokens=50, seconds=2.0, ticks_per_s=100.0)
    cpu_s = result["cpu_s"]
    assert cpu_s["router"] == pytest.approx(2.0)
    assert cpu_s["verifier"] == pytest.approx(1.0)
    assert cpu_s["drafter"] == pytest.approx(0.5 + 0.5)
    assert cpu_s["ray"] == pytest.approx(0.25)
    assert cpu_s["proxy"] == cpu_s["other"] == 0.0
    assert cpu_s[CLIENT] == pytest.approx(0.2)
    assert cpu_s[SERVICE_TOTAL] == pytest.approx(4.25)  # the client apart
    per_token = result["cpu_ms_per_token"]
    assert per_token["router"] == pytest.approx(40.0)  # 2000 ms / 50 tokens
    assert per_token[SERVICE_TOTAL] == pytest.approx(85.0)
    assert per_token[CLIENT] == pytest.approx(4.0)
    assert result["cores"]["router"] == pytest.approx(1.0)
    assert set(per_token) == {*ROLES, CLIENT, SERVICE_TOTAL}
    drafters = [p for p in result["processes"] if p["role"] == "drafter"]
    assert sorted(p["pid"] for p in drafters) == [3, 4]  # each replica apart
    assert all(p["cpu_ms_per_token"] == pytest.approx(10.0) for p in drafters)
    assert 7 in {p["pid"] for p in result["processes"]}  # the new pid 7; the old one used none


def test_no_token_has_no_per_token_figure() -> None:
    result = usage([_snapshot(_reading(1, 0, "router")), _snapshot(_reading(1, 10, "router"))],
                   tokens=0, seconds=1.0, ticks_per_s=100.0)  # fmt: skip
    assert result["cpu_s"]["router"] == pytest.approx(0.1)
    assert result["cpu_ms_per_token"]["router"] is None
    with pytest.raises(ValueError, match="at least one snapshot"):
        usage([], 1, 1.0, 100.0)


def test_add_usage_sums_windows_then_divides() -> None:
    one = usage([_snapshot(_reading(1, 0, "router")), _snapshot(_reading(1, 30, "router"))],
                tokens=10, seconds=1.0, ticks_per_s=100.0)  # fmt: skip
    two = usage([_snapshot(_reading(1, 30, "router")), _snapshot(_reading(1, 40, "router"))],
                tokens=30, seconds=1.0, ticks_per_s=100.0)  # fmt: skip
    both = add_usage([one, two])
    assert both["tokens"] == 40 and both["seconds"] == 2.0
    assert both["cpu_ms_per_token"]["router"] == pytest.approx(400 / 40)  # not a mean of 30, 3.3
    assert [p["cpu_s"] for p in both["processes"]] == [pytest.approx(0.4)]


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_a_window_counts_this_process_and_its_children_as_the_load_client() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: pass"])
    try:
        window = CpuWindow(NO_SERVICE, interval_s=0.05)
        window.start()
        _burn(0.2)
        # Wait (bounded) for a poll that saw the child spin, then end it inside the window:
        # it counts to its last reading.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
            r.pid == child.pid and r.cpu_ticks > 0
            for s in window._snapshots[1:]
            for r in s.values()
        ):
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait()
        result = window.stop(tokens=100, seconds=1.0)
    finally:
        child.kill()
        child.wait()
    by_pid = {p["pid"]: p for p in result["processes"]}
    assert by_pid[os.getpid()]["role"] == CLIENT and by_pid[os.getpid()]["cpu_s"] > 0
    assert by_pid[child.pid]["role"] == CLIENT and by_pid[child.pid]["cpu_s"] > 0
    assert result["cpu_s"][SERVICE_TOTAL] == 0.0  # nothing in scope
    assert result["cpu_ms_per_token"][CLIENT] > 0
    assert result["scope"] == NO_SERVICE.description


def test_a_poll_rereads_the_processes_it_knows() -> None:
    me = next(r for r in read_snapshot(NO_SERVICE).values() if r.pid == os.getpid())
    gone = Reading(2**22 + 1, 1, 5, 7, "router", "gone")  # past the largest pid Linux gives
    reused = Reading(os.getpid(), 1, me.start_ticks + 1, 0, "ray", "an earlier process")
    _burn(0.05)
    again = process_cpu.reread({me.key: me, gone.key: gone, reused.key: reused})
    assert list(again) == [me.key]
    assert again[me.key].cpu_ticks >= me.cpu_ticks and again[me.key].role == CLIENT


def test_user_scope_finds_a_ray_title_outside_the_client() -> None:
    """A process titled as a verifier replica, orphaned (so not this process's descendant),
    is found in this user's processes with its role; this process stays the client."""
    title = "ray::ServeReplica:test:Verifier"
    spawned = subprocess.run(
        ["bash", "-c", f"(exec -a '{title}' sleep 60) </dev/null >/dev/null 2>&1 & echo $!"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    pid = int(spawned.stdout)
    cmdline = Path(f"/proc/{pid}/cmdline")
    try:
        deadline = time.monotonic() + 30  # until the subshell has become `sleep`
        while time.monotonic() < deadline and not cmdline.read_bytes().startswith(b"ray::"):
            time.sleep(0.01)
        snapshot = read_snapshot(user_scope())
        roles = {r.pid: r.role for r in snapshot.values()}
        assert roles[pid] == "verifier"
        assert roles[os.getpid()] == CLIENT
        # Another user's processes are not in scope.
        assert pid not in {r.pid for r in read_snapshot(user_scope(os.getuid() + 1)).values()}
    finally:
        os.kill(pid, signal.SIGKILL)


def test_calls_of_named_runs_add_up() -> None:
    calls = CpuCalls(NO_SERVICE, ["counted"])
    assert calls.open("not counted") is None
    for _ in range(2):
        finish = calls.open("counted")
        assert finish is not None
        _burn(0.05)
        finish(10, 0.05)
    fields = calls.fields()
    assert set(fields) == {"counted"}
    assert fields["counted"]["cpu_ms_per_token"][CLIENT] > 0
    assert set(fields["counted"]["cpu"]) == {"cpu_s", "cores", "processes"}


def test_printed_forms() -> None:
    per_token = dict.fromkeys((*ROLES, SERVICE_TOTAL, CLIENT), 0.0)
    per_token |= {"router": 0.8, "verifier": 0.55, "proxy": 0.5, SERVICE_TOTAL: 1.85, CLIENT: 0.1}
    table = cpu_table(("concurrency", "mode"), [(("64", "speculative"), per_token)])
    assert table.splitlines()[0].startswith("| concurrency | mode | router | proxy |")
    assert "| 64 | speculative | 0.800 | 0.500 | 0.000 |" in table
    assert cpu_line(per_token) == (
        "CPU ms/token: service 1.850 (router 0.80, verifier 0.55, proxy 0.50), load client 0.100"
    )
    assert "| – |" in cpu_table(("run",), [(("x",), {"router": None})])
