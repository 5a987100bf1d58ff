"""`tandem plan`: which drafter kind and block length to use per workload category at a load,
how many drafter replicas and streams a verifier needs and serves, and the tokens/s and ITL
to expect with speculation and with the target alone; `--check FILE` puts the plan beside a
measured `tandem loadtest` result instead.

The math is `cluster.plan` (pure); this module reads the flags and files, picks the shipped
figures of the preset (`cluster.plan.defaults`) and prints. Runs with no service and no
download.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from cluster.runtime.errors import InvalidArgumentError

DEFAULT_CLIENTS = (1, 16, 64)


def add_to(commands: Any) -> None:
    p = commands.add_parser(
        "plan", help="plan drafter kinds, replicas and expected tokens/s for a load"
    )
    p.add_argument("--preset", default="sim-h100-8b", help="sim-h100-8b (default) or qwen-coder")
    p.add_argument(
        "--clients", type=int, nargs="+", default=list(DEFAULT_CLIENTS),
        help="concurrent streams, one plan each (default: 1 16 64)",
    )  # fmt: skip
    p.add_argument("--verifiers", type=int, default=1, help="verifier replicas (default 1)")
    p.add_argument("--category", nargs="+", help="workload categories (default: every one)")
    p.add_argument(
        "--acceptance", metavar="FILE",
        help="a tandem bench JSON, or {category: {kind: alpha}} (default: the preset's)",
    )  # fmt: skip
    p.add_argument(
        "--cpu-ms-per-token", type=float,
        help="the host's CPU a generated token, flat (default: the preset's measured a + b/N)",
    )  # fmt: skip
    p.add_argument("--cores", type=float, help="cores the service may use (default: measured)")
    p.add_argument("--itl-ms", type=float, help="target ITL for clients per verifier")
    p.add_argument("--context-tokens", type=int, help="streams' mean context (prompt + half out)")
    p.add_argument(
        "--prompt-tokens", type=int,
        help="a request's mean prompt, prefilled on the verifier (default: the preset's)",
    )  # fmt: skip
    p.add_argument(
        "--output-tokens", type=int,
        help="a request's mean generated tokens (default: the preset's, or --check's max_tokens)",
    )  # fmt: skip
    p.add_argument("--check", metavar="FILE", help="a tandem loadtest JSON: predicted beside it")
    p.add_argument(
        "--calibrate", metavar="FILE",
        help="fit the host term to a tandem loadtest JSON of this host; print it and the check",
    )  # fmt: skip
    p.add_argument(
        "--sampled", action="store_true",
        help="plan sampled requests (temperature > 0): the preset's host term for them",
    )  # fmt: skip
    p.add_argument(
        "--host", metavar="FILE",
        help="the host term from a file (`--calibrate FILE --json`'s `host`, or that object)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(handler=plan_command)


def plan_command(args: argparse.Namespace) -> int:
    from cluster.plan.check import check_rows
    from cluster.plan.defaults import PRESETS
    from cluster.plan.inputs import acceptance_from_json
    from cluster.plan.level import plan_level

    if args.preset not in PRESETS:
        raise InvalidArgumentError(
            f"--preset: no planning figures for {args.preset!r}; known: {', '.join(PRESETS)}"
        )
    inputs = PRESETS[args.preset]
    if args.acceptance:
        inputs = dataclasses.replace(
            inputs, acceptance=acceptance_from_json(_read_json(args.acceptance, "--acceptance"))
        )
    inputs = _with_request_shape(inputs, args)
    host = inputs.host
    if args.sampled:
        if inputs.sampled_host is None:
            raise InvalidArgumentError(
                f"--sampled: {inputs.name} has no host term of its own for sampled requests"
            )
        host = inputs.sampled_host
    if args.host:
        fitted = _read_json(args.host, "--host")
        host = _host_from_json(fitted)
        inputs = _device_from_json(inputs, fitted)
    if args.cpu_ms_per_token is not None:
        host = dataclasses.replace(
            host, cpu_ms_per_token=args.cpu_ms_per_token, cpu_ms_per_round=0.0, cpu_ms_per_step=0.0
        )
    if args.cores is not None:
        host = dataclasses.replace(host, usable_cores=args.cores)
    categories = args.category or list(inputs.acceptance)
    unknown = [c for c in categories if c not in inputs.acceptance]
    if unknown:
        raise InvalidArgumentError(
            f"--category: no acceptance figures for {', '.join(unknown)}; "
            f"known: {', '.join(inputs.acceptance)}"
        )
    if any(n < 1 for n in args.clients) or args.verifiers < 1:
        raise InvalidArgumentError("--clients and --verifiers must be >= 1")
    if args.calibrate:
        return _calibrate(inputs, args.calibrate, categories[0], args.json)
    if args.check:
        rows = check_rows(inputs, _read_json(args.check, "--check"), categories[0], host)
        print(
            json.dumps([_check_dict(r) for r in rows], indent=2)
            if args.json
            else _check_table(rows)
        )
        return 0
    levels = [
        plan_level(inputs, n, categories, args.verifiers, args.itl_ms, host) for n in args.clients
    ]
    if args.json:
        print(json.dumps(_plan_dict(inputs, host, levels), indent=2))
    else:
        print(_plan_text(inputs, host, levels, args.itl_ms))
    return 0


def _calibrate(inputs: Any, path: str, category: str, as_json: bool) -> int:
    from cluster.plan.calibrate import calibrate
    from cluster.plan.check import check_rows

    result = _read_json(path, "--calibrate")
    fitted = calibrate(inputs, result, category, source=f"fitted to {path}")
    host = fitted.host
    rows = check_rows(fitted, result, category, host)
    device = _device_dict(fitted) if fitted.device_is_host else None
    if as_json:
        body: dict[str, Any] = {"host": dataclasses.asdict(host)}
        if device is not None:
            body["device"] = device
        body["check"] = [_check_dict(r) for r in rows]
        print(json.dumps(body, indent=2))
        return 0
    print(
        f"host fitted to {path}: {host.usable_cores:.2f} cores; CPU a token "
        f"{host.cpu_ms_per_token:.3f} + ({host.cpu_ms_per_round:.3f} + "
        f"{host.cpu_ms_per_step:.3f} / N) / E ms, {host.critical_share:.2f} of it on the "
        "round's path"
    )
    if device is not None:
        target = fitted.target
        print(
            f"device (the host's own cores) fitted too: a step {target.base_s * 1e3:.1f} ms + "
            f"{target.per_token_s * 1e3:.2f} ms a token of the batch; prefill "
            f"{fitted.prefill_s() * 1e3:,.0f} ms for {fitted.prompt_tokens} prompt tokens"
        )
    print("(save `--json`'s output as a file and pass it with --host)\n")
    print(_check_table(rows))
    return 0


def _device_dict(inputs: Any) -> dict[str, Any]:
    target = inputs.target
    return {
        "target": {"base_s": target.base_s, "per_token_s": target.per_token_s,
                   "per_context_s": target.per_context_s},
        "prefill_s_per_token": inputs.prefill_s_per_token,
        "prefill_s_per_token_squared": inputs.prefill_s_per_token_squared,
    }  # fmt: skip


def _device_from_json(inputs: Any, data: Any) -> Any:
    """`inputs` with a fitted device (`--calibrate --json`'s `device`), if the file has one."""
    from cluster.runtime.sim_source import DeviceProfile

    device = data.get("device") if isinstance(data, dict) else None
    if device is None:
        return inputs
    try:
        target = DeviceProfile(**device["target"], source="fitted (--host)")
        return dataclasses.replace(
            inputs,
            target=target,
            prefill_s_per_token=device.get("prefill_s_per_token"),
            prefill_s_per_token_squared=device.get("prefill_s_per_token_squared"),
        )
    except (KeyError, TypeError) as error:
        raise InvalidArgumentError(f"--host: a bad device: {error}") from None


def _host_from_json(data: Any) -> Any:
    from cluster.plan.inputs import HostCost

    if isinstance(data, dict) and isinstance(data.get("host"), dict):
        data = data["host"]
    fields = {f.name for f in dataclasses.fields(HostCost)}
    if not isinstance(data, dict) or "usable_cores" not in data:
        raise InvalidArgumentError("--host: expected an object with usable_cores and CPU figures")
    unknown = sorted(set(data) - fields)
    if unknown:
        raise InvalidArgumentError(f"--host: unknown fields {', '.join(unknown)}")
    try:
        return HostCost(**data)
    except TypeError as error:
        raise InvalidArgumentError(f"--host: {error}") from None


def _with_request_shape(inputs: Any, args: argparse.Namespace) -> Any:
    """The preset's figures with the flags' prompt, output and context lengths; a prompt or
    output length given without a context makes the context prompt + half the output."""
    shape = {
        name: getattr(args, name)
        for name in ("prompt_tokens", "output_tokens", "context_tokens")
        if getattr(args, name) is not None
    }
    if not shape:
        return inputs
    if "context_tokens" not in shape:
        prompt = shape.get("prompt_tokens", inputs.prompt_tokens)
        shape["context_tokens"] = round(
            prompt + shape.get("output_tokens", inputs.output_tokens) / 2
        )
    if any(value < 0 for value in shape.values()):
        raise InvalidArgumentError("--prompt-tokens, --output-tokens, --context-tokens: >= 0")
    return dataclasses.replace(inputs, **shape)


def _read_json(path: str, flag: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise InvalidArgumentError(f"{flag}: cannot read {path}: {error}") from None


def _plan_dict(inputs: Any, host: Any, levels: list[Any]) -> dict[str, Any]:
    def estimate(e: Any) -> dict[str, Any]:
        return {
            **dataclasses.asdict(e),
            "drafters_per_verifier": e.drafters_per_verifier,
            "routers_per_verifier": e.routers_per_verifier,
        }

    return {
        "preset": inputs.name,
        "context_tokens": inputs.context_tokens,
        "host": dataclasses.asdict(host),
        "sources": dict(inputs.sources),
        "levels": [
            {
                "clients": level.clients,
                "verifiers": level.verifiers,
                "mixed_tokens_per_s": level.mixed_tokens_per_s,
                "mixed_target_alone_tokens_per_s": level.mixed_target_alone_tokens_per_s,
                "mixed_speedup": level.mixed_speedup,
                "categories": [
                    {
                        "category": c.category,
                        "best": estimate(c.best),
                        "target_alone": estimate(c.target_alone),
                        "speedup": c.speedup,
                        "clients_per_verifier": c.clients_per_verifier,
                        "by_kind": {kind: estimate(e) for kind, e in c.by_kind.items()},
                    }
                    for c in level.categories
                ],
            }
            for level in levels
        ],
    }


def _plan_text(inputs: Any, host: Any, levels: list[Any], itl_ms: float | None) -> str:
    served = f"at ITL <= {itl_ms:g} ms" if itl_ms is not None else "at saturation"
    lines = [
        f"plan for {inputs.name}: context {inputs.context_tokens} tokens; "
        f"host {host.usable_cores:g} cores, "
        f"CPU {host.cpu_ms_per_token:.3g} + ({host.cpu_ms_per_round:.3g} + "
        f"{host.cpu_ms_per_step:.3g}/N)/E ms a token ({host.critical_share:.2g} on the round's "
        "path), "
        f"{host.latency_ms_per_round:g} ms a round off-core ({host.source})",
    ]
    header = (
        "| category | kind | k | alpha | tokens/s | ITL ms | target alone tokens/s | ITL ms "
        f"| ratio | drafters per verifier | routers per verifier "
        f"| clients per verifier ({served}) | capacity factor |"
    )
    for level in levels:
        lines += ["", f"{level.clients} clients, {level.verifiers} verifier(s):", header,
                  "|" + "---|" * 13]  # fmt: skip
        for c in level.categories:
            b, t = c.best, c.target_alone
            drafters = ", ".join(
                f"{kind} {e.drafters_per_verifier} ({e.drafter_load:.2f})"
                for kind, e in c.by_kind.items()
            )
            factor = f"{b.capacity_factor:.2f}" if b.capacity_factor is not None else "-"
            lines.append(
                f"| {c.category} | {b.kind} | {b.draft_tokens} | {b.alpha:.2f} "
                f"| {b.tokens_per_s:,.0f} | {b.itl_ms:.2f} "
                f"| {t.tokens_per_s:,.0f} | {t.itl_ms:.2f} "
                f"| {c.speedup:.2f}x | {drafters} "
                f"| {b.routers_per_verifier} ({b.router_load:.2f}) "
                f"| {c.clients_per_verifier} | {factor} |"
            )
        lines.append(
            f"| mix (equal tokens) | | | | {level.mixed_tokens_per_s:,.0f} "
            f"| {level.itl_ms(level.mixed_tokens_per_s):.2f} "
            f"| {level.mixed_target_alone_tokens_per_s:,.0f} "
            f"| {level.itl_ms(level.mixed_target_alone_tokens_per_s):.2f} "
            f"| {level.mixed_speedup:.2f}x | | | | |"
        )
    router = inputs.router
    lines += [
        "",
        "drafters per verifier: replicas (their load in replicas' worth of work)",
        f"routers per verifier: router replicas to keep its device fed at its ideal rate, at "
        f"{router.cpu_ms_per_token:g} ms of a router's CPU a token + "
        f"{router.cpu_ms_per_round:g} ms a drafting round, {router.core_share:g} of a core a "
        f"router ({router.source or 'assumed'})",
    ]
    lines += [f"{key}: {value}" for key, value in inputs.sources.items()]
    return "\n".join(lines)


def _check_dict(row: Any) -> dict[str, Any]:
    return {**dataclasses.asdict(row), "ratio": row.ratio, "measured_cores": row.measured_cores}


def _check_table(rows: list[Any]) -> str:
    lines = [
        "| streams | mode | priced as | measured tokens/s | predicted tokens/s "
        "| predicted / measured | measured CPU ms/token | predicted CPU ms/token | cores used |",
        "|" + "---|" * 9,
    ]
    for r in rows:
        cpu = f"{r.measured_cpu_ms_per_token:.2f}" if r.measured_cpu_ms_per_token else "-"
        cores = f"{r.measured_cores:.2f}" if r.measured_cores is not None else "-"
        priced = (
            "target alone"
            if r.kind == "none"
            else f"{r.kind} k {r.draft_tokens} alpha {r.alpha:.2f}"
        )
        lines.append(
            f"| {r.concurrency} | {r.mode} | {priced} | {r.measured_tokens_per_s:,.1f} "
            f"| {r.predicted_tokens_per_s:,.1f} | {r.ratio:.2f} | {cpu} "
            f"| {r.predicted_cpu_ms_per_token:.2f} | {cores} |"
        )
    return "\n".join(lines)
