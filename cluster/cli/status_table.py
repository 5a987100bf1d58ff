"""What `tandem status` prints, from the summary its `--json` prints whole.

`status_lines(summary)` is the text form: the application and its status, both doors'
addresses, each deployment's replicas by state, the replica table (`replica_lines`: Ray node,
internal address, sessions, load, the engine's batch and KV blocks, the resources Ray granted),
the draft-to-target step ratio measured at start-up (`step_ratio`, `step_ratio_line`) and the
metrics summary with usage per tenant (`metrics_lines`, from `cluster.metrics.summarize`).
The summary is a dict as `cluster.cli.service` gathers it: `app`, `status`, `address`,
`http_address`, `proxy_address`, `proxy_http_address`, `deployments`, `replicas`, `metrics`
(None where no metrics agent answered). Pure: text from dicts, nothing read or printed here.
"""

from __future__ import annotations

from typing import Any

from cluster.metrics.catalog import replica_numbers


def status_lines(summary: dict[str, Any]) -> list[str]:
    """`tandem status` without `--json`, a line each."""
    lines = [
        f"Tandem app {summary['app']!r}: {summary['status']}",
        f"  gRPC API on {summary['address']}; OpenAI-compatible API on {summary['http_address']}",
        f"  through Serve's proxies: gRPC {summary['proxy_address']}, "
        f"HTTP {summary['proxy_http_address']}",
    ]
    for name, deployment in summary["deployments"].items():
        replicas = ", ".join(f"{n} {s}" for s, n in deployment["replicas"].items())
        lines.append(f"  {name:<9} {deployment['status']:<10} {replicas}")
    lines += replica_lines(summary["replicas"])
    ratio_line = step_ratio_line(summary["replicas"])
    if ratio_line is not None:
        lines.append(ratio_line)
    if summary["metrics"] is not None:
        lines += metrics_lines(summary["metrics"])
    return lines


NODE_ID_CHARS = 12
"""How much of a Ray node id the replica table shows: enough to tell nodes apart (the ids are
random); `--json` has the whole id."""


def replica_lines(replicas: list[dict[str, Any]]) -> list[str]:
    """The replica table of `tandem status`: a header, then one line per replica: its Ray node
    (the id's first `NODE_ID_CHARS` hex digits) and internal gRPC address, its load fields, its
    engine's batch (smoothed, and the most since start) and KV blocks used of total, and the
    resources Ray granted it (its group's). `-` where there is nothing to show: no engine runs,
    no resources were asked for, or a replica too old to report its node."""
    shown = {"num_sessions", "num_cached_tokens"}
    load = sorted({f for r in replicas for f in replica_numbers(r)} - shown)
    lines = [
        f"  {'replica':<22} {'side':<8} {'node':<{NODE_ID_CHARS}} {'address':<17} "
        f"{'sessions':>8} {'cached tokens':>14}"
        + "".join(f" {field:>{max(len(field), 12)}}" for field in load)
        + f" {'batch (max)':>12} {'kv blocks':>15}  resources"
    ]
    for replica in replicas:
        batch, kv_blocks = _engine_columns(replica.get("engine"))
        node = str(replica.get("node_id") or "-")[:NODE_ID_CHARS]
        lines.append(
            f"  {replica['replica_id']:<22} {replica['side']:<8} {node:<{NODE_ID_CHARS}} "
            f"{replica['address']:<17} "
            f"{replica['num_sessions']:>8} {replica['num_cached_tokens']:>14}"
            + "".join(f" {_number(replica.get(f)):>{max(len(f), 12)}}" for f in load)
            + f" {batch:>12} {kv_blocks:>15}  {resource_list(replica.get('resources'))}"
        )
    return lines


def step_ratio(replicas: list[dict[str, Any]]) -> tuple[float, float, float] | None:
    """(draft step / target step, draft step s, target step s): one-token steps as the
    replicas measured them at start-up (`EngineStats.startup_base_s`), the mean over each
    side's model replicas; None where a side has none that measured (no drafter model, or
    replicas too old to report it)."""
    steps: dict[str, list[float]] = {"drafter": [], "verifier": []}
    for replica in replicas:
        engine = replica.get("engine")
        if not isinstance(engine, dict) or replica.get("side") not in steps:
            continue
        step_s = float(engine.get("startup_base_s") or 0) + float(
            engine.get("startup_per_token_s") or 0
        )
        if step_s > 0:
            steps[str(replica["side"])].append(step_s)
    if not steps["drafter"] or not steps["verifier"]:
        return None
    draft_s = sum(steps["drafter"]) / len(steps["drafter"])
    target_s = sum(steps["verifier"]) / len(steps["verifier"])
    return draft_s / target_s, draft_s, target_s


def step_ratio_line(replicas: list[dict[str, Any]]) -> str | None:
    """The measured draft-to-target step ratio in words; None where it is not known."""
    ratio = step_ratio(replicas)
    if ratio is None:
        return None
    value, draft_s, target_s = ratio
    return (
        f"  draft step / target step, measured at start-up: {value:.2f} "
        f"(drafter {1000 * draft_s:.1f} ms, verifier {1000 * target_s:.1f} ms a one-token step)"
    )


def resource_list(resources: Any) -> str:
    """Ray resources as `name=amount`, comma-separated by name (`-` for none)."""
    if not isinstance(resources, dict) or not resources:
        return "-"
    return ",".join(f"{name}={amount:g}" for name, amount in sorted(resources.items()))


def _engine_columns(engine: Any) -> tuple[str, str]:
    """Batch and KV columns of a replica's `engine` object, `-` where it has none."""
    if not isinstance(engine, dict):
        return "-", "-"
    figure = {name: _number(engine.get(name)) for name in _ENGINE_COLUMNS}
    batch = f"{figure['batch_sequences']} ({figure['max_batch_sequences']})"
    return batch, f"{figure['kv_blocks_used']}/{figure['kv_blocks_total']}"


_ENGINE_COLUMNS = ("batch_sequences", "max_batch_sequences", "kv_blocks_used", "kv_blocks_total")


def _number(value: Any) -> str:
    if value is None:
        return "-"
    return (
        f"{value:.2f}" if isinstance(value, float) and not value.is_integer() else str(int(value))
    )


def metrics_lines(metrics: dict[str, Any]) -> list[str]:
    """The metrics summary: acceptance, tokens per verify pass, pipeline hit rate, the queue;
    then a row of usage per tenant."""
    by_position = " ".join(_number(a) for a in metrics["acceptance_by_position"])
    lines = [
        f"  metrics: {metrics['requests']} requests, {metrics['generated_tokens']} tokens "
        f"generated; acceptance {_number(metrics['acceptance_rate'])} (by position: "
        f"{by_position or '-'}); {_number(metrics['tokens_per_verify_pass'])} tokens per "
        f"verify pass; pipeline hit rate {_number(metrics['pipeline_hit_rate'])}; "
        f"{metrics['running_requests']} running, {metrics['queued_requests']} queued"
    ]
    columns = ("requests", "refused", "prompt_tokens", "generated_tokens", "drafted_tokens",
               "accepted_tokens")  # fmt: skip
    lines.append(
        f"  {'tenant':<16}" + "".join(f" {c.removesuffix('_tokens'):>10}" for c in columns)
    )
    for tenant, usage in metrics["tenants"].items():
        lines.append(f"  {tenant:<16}" + "".join(f" {usage[c]:>10}" for c in columns))
    return lines
