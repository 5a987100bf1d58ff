"""Which role a process of a Tandem service plays, from the command line Ray workers retitle
themselves with (`classify`), and a short name for it (`process_name`).

- `router`, `drafter`, `verifier`, `suffix`: `ray::ServeReplica:<app>:Router` (the ingress),
  `:Drafter`, `:Verifier`, `:SuffixDrafter` (the deployment names of `cluster.serve.app`);
  each replica is also listed apart in a window's `processes`.
- `proxy`: `ray::ProxyActor`, Serve's HTTP and gRPC proxy; `controller`: `ray::ServeController`;
  `registry`: `ray::ReplicaRegistry`, Tandem's replica registry actor.
- `ray`: Ray's own processes: gcs_server, raylet, the dashboard and its agents, the log
  monitor, the autoscaler monitor, the Ray client server, and any other `ray::` worker.
- `other`: a process of the cluster that is none of these (another driver, or a Serve replica
  of another deployment).
- `load_client` (`CLIENT`): the measuring process and its descendants, whatever their command
  line: reported apart, and never in `service_total` (`SERVICE_TOTAL`, the sum of `ROLES`).
  A window's own polls count here.

A command line that none of these matches is not a Ray or Tandem process (None). Pure: text in,
names out.
"""

from __future__ import annotations

import os

ROLES = (
    "router", "proxy", "controller", "registry", "drafter", "verifier", "suffix", "ray", "other",
)  # fmt: skip
"""The service's roles, in report order; `service_total` is their sum."""
CLIENT = "load_client"
SERVICE_TOTAL = "service_total"

DEPLOYMENT_ROLES = {
    "Router": "router", "Drafter": "drafter", "Verifier": "verifier", "SuffixDrafter": "suffix",
}  # fmt: skip
"""Serve deployment name (cluster.serve.app) -> role."""
ACTOR_ROLES = {
    "ProxyActor": "proxy",
    "ServeController": "controller",
    "ReplicaRegistry": "registry",
}
"""The title after `ray::` of the other actors with a role of their own -> role."""
RAY_TITLE = "ray::"
SERVE_REPLICA = "ServeReplica:"
RAY_PROGRAMS = (
    "ray/core/src/ray/gcs/gcs_server", "ray/core/src/ray/raylet/raylet",
    "ray/dashboard/dashboard.py", "ray/dashboard/agent.py", "ray/_private/log_monitor.py",
    "ray/autoscaler/_private/monitor.py", "ray/_private/runtime_env/agent/main.py",
    "ray/_private/workers/default_worker.py", "ray.util.client.server",
)  # fmt: skip
"""Fragments of the program (or script, or module) of Ray's own processes, as they read
before a `ray::` title, or without one."""


def classify(cmdline: str) -> str | None:
    """The role of a process from its command line (NUL-separated as in /proc, or with spaces);
    None: not a Ray or Tandem process."""
    actor = _ray_actor(cmdline)
    if actor is not None:
        if actor.startswith(SERVE_REPLICA):
            return DEPLOYMENT_ROLES.get(actor.rpartition(":")[2], "other")
        return ACTOR_ROLES.get(actor, "ray")
    words = cmdline.replace("\0", " ").split()
    if any(program in word for word in words[:4] for program in RAY_PROGRAMS):
        return "ray"
    return None


def process_name(cmdline: str) -> str:
    """A short name: a Ray worker's title without `ray::` and the method it runs now, else the
    program (or the script a Python runs, or its `-m` module)."""
    actor = _ray_actor(cmdline)
    if actor is not None:
        return actor
    words = cmdline.replace("\0", " ").split()
    if not words:
        return "?"
    program = os.path.basename(words[0])
    if program.startswith("python"):
        rest = [w for w in words[1:] if not w.startswith("-") or w == "-m"]
        if rest[:1] == ["-m"] and len(rest) > 1:
            return rest[1]
        if rest:
            return os.path.basename(rest[0])
    return program


def _ray_actor(cmdline: str) -> str | None:
    """What a Ray worker's title names, without the method it runs now: `ray::ServeController
    .listen_for_change` -> `ServeController`, `ray::ServeReplica:tandem:Router.handle_request`
    -> `ServeReplica:tandem:Router`; None for a process with no `ray::` title."""
    words = cmdline.replace("\0", " ").split(maxsplit=1)
    if not words or not words[0].startswith(RAY_TITLE):
        return None
    title = words[0].removeprefix(RAY_TITLE)
    if title.startswith(SERVE_REPLICA):  # the app's name may hold a dot; a deployment's not
        head, _, deployment = title.rpartition(":")
        return f"{head}:{deployment.split('.')[0]}"
    return title.split(".")[0]
