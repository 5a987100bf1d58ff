"""Grammar engines for structured outputs, measured on one tokenizer's full vocabulary.

`python -m experiments.grammar.bench --tokenizer PATH [--engines llguidance xgrammar
outlines-core] [--json OUT]` measures each engine that imports (one that does not is skipped,
and the report says why) on three workloads, each with a valid output to walk: a JSON schema,
a regex and a Lark grammar (`experiments.grammar.workloads`). The engines sit behind one
interface (`experiments.grammar.engines`); what is measured per engine and workload (compile
and mask times, rollback, k + 1 block masks, the GIL) is listed in
`experiments.grammar.measure`.

Each (engine, workload) pair runs in a child process of its own, so engines never share imports
or threads, and a compile still running after `--timeout-s` is killed and reported as timed
out. `--summarize A.json B.json ...` prints the Markdown tables of medians over earlier runs.
This module is the command line: it runs the children, gathers their reports with the
packages' versions and sizes, and renders the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

from experiments.grammar.engines import ENGINES, engine
from experiments.grammar.measure import (
    DRAFT_TOKENS,
    OK,
    ROLLBACK_TOKENS,
    WorkloadReport,
    measure,
)
from experiments.grammar.workloads import WORKLOADS

DEFAULT_TIMEOUT_S = 60.0


def _child(args: argparse.Namespace) -> None:
    """Measure one (engine, workload) and print its report as the last line."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    grammar_engine = engine(args.child[0])
    try:
        __import__(grammar_engine.module)
    except ImportError as error:
        print(json.dumps({"status": f"skipped: cannot import {grammar_engine.module}: {error}"}))
        return
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):  # as each engine's reader needs
        print(json.dumps({"status": f"failed: {args.tokenizer} has no fast tokenizer"}))
        return
    vocab_size = args.vocab_size or len(tokenizer)

    def announce() -> None:  # the parent's clock: it kills a compile that runs too long
        print(json.dumps({"compile_started_at": time.time()}), flush=True)

    try:
        report = measure(grammar_engine, tokenizer, vocab_size, WORKLOADS[args.child[1]], announce)
    except Exception as error:  # an engine's own error is a result to report, not a crash
        report = WorkloadReport(status=f"failed: {type(error).__name__}: {error}")
    print(json.dumps(asdict(report) | {"vocab_size": vocab_size}))


def _run_child(args: argparse.Namespace, name: str, kind: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "experiments.grammar.bench", "--tokenizer", args.tokenizer]
    command += ["--child", name, kind]
    if args.vocab_size:
        command += ["--vocab-size", str(args.vocab_size)]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=args.timeout_s, check=False
        )
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout
        started = re.findall(r'"compile_started_at": ([0-9.]+)', out or "")
        if started:
            compiling_s = time.time() - float(started[-1])
            return {"status": f"timed out: compile still running after {compiling_s:.0f} s"}
        return {"status": f"timed out after {args.timeout_s:.0f} s, before compiling"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"status": f"failed: exit {done.returncode}: {done.stderr.strip()[-300:]}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _package(distribution: str) -> dict[str, Any]:
    """Version, installed size and runtime requirements (each with its installed size)."""
    version = metadata.version(distribution)
    requires = []
    for line in metadata.requires(distribution) or []:
        if "extra ==" in line:
            continue
        name = re.match(r"[A-Za-z0-9._-]+", line)
        requires.append(
            {"requirement": line, "installed_mb": _installed_mb(name[0] if name else "")}
        )
    return {"version": version, "installed_mb": _installed_mb(distribution), "requires": requires}


def _installed_mb(distribution: str) -> float | None:
    try:
        files = metadata.distribution(distribution).files or []
    except metadata.PackageNotFoundError:
        return None
    return sum(f.size or 0 for f in files) / 2**20


def _processor() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    names = re.findall(r"model name\s*: (.*)", cpuinfo.read_text()) if cpuinfo.exists() else []
    return names[0] if names else platform.machine()


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "tokenizer": args.tokenizer,
        "machine": {"cpus": os.cpu_count(), "processor": _processor()},
        "load_average_at_start": os.getloadavg(),
        "python": platform.python_version(),
        "settings": {"rollback_tokens": ROLLBACK_TOKENS, "draft_tokens": DRAFT_TOKENS},
        "engines": {},
    }
    for name in args.engines:
        grammar_engine = engine(name)
        try:
            entry: dict[str, Any] = _package(name)
        except metadata.PackageNotFoundError:
            print(f"{name}: skipped, not installed", file=sys.stderr)
            report["engines"][name] = {"status": "skipped: not installed"}
            continue
        entry |= {
            "rollback_api": grammar_engine.rollback_api,
            "block_api": grammar_engine.block_api,
        }
        entry["workloads"] = {}
        for kind in WORKLOADS:
            result = _run_child(args, name, kind)
            print(f"{name} {kind}: {json.dumps(result)}", file=sys.stderr)
            if result["status"].startswith("skipped"):
                print(f"{name}: {result['status']}", file=sys.stderr)
                entry["status"] = result["status"]
                break
            entry["workloads"][kind] = result
        report["engines"][name] = entry
    report["load_average_at_end"] = os.getloadavg()
    return report


WORKLOAD_COLUMNS = (
    ("compile s", "compile_s"),
    ("compile: longest GIL stall ms", "compile_stall_ms"),
    ("first mask µs", "first_mask_us"),
    ("mask µs median", "mask_median_us"),
    ("p90", "mask_p90_us"),
    ("max", "mask_max_us"),
    ("reset, median", "warm_mask_median_us"),
    ("p90", "warm_mask_p90_us"),
    ("end allowed", "end_allowed"),
    ("rollback: same mask", "rollback_verified"),
    ("k+1 block µs, loop", "block_median_us"),
    ("native call", "native_block_median_us"),
    ("native = loop", "native_block_matches"),
    ("GIL-free share of long mask calls", "gil_free_share"),
)
"""The workload table's columns: each cell is the median over runs, or yes/no for a check
(no if any run said no)."""


def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _cell(values: Sequence[Any]) -> str:
    if any(isinstance(v, bool) for v in values):
        return "no" if False in values else "yes"
    numbers = [v for v in values if isinstance(v, int | float)]
    return _number(statistics.median(numbers)) if numbers else "-"


def _status_cell(statuses: Sequence[str]) -> str:
    waits = [int(w) for s in statuses for w in re.findall(r"still running after (\d+) s", s)]
    if len(waits) == len(statuses):
        return f"timed out: compile still running after {min(waits)}-{max(waits)} s"
    return "; ".join(sorted(set(statuses)))


def render(runs: Sequence[dict[str, Any]]) -> str:
    """Markdown tables of the medians over `runs` (reports of `run`): one row per engine,
    then one per engine and workload."""
    names = [name for name in ENGINES if any(name in r["engines"] for r in runs)]
    lines = [
        "| engine | version | installed MB | requires (installed MB) | tokenizer build s | "
        "rollback | k+1 block call |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = []
    for name in names:
        entries = [r["engines"][name] for r in runs if name in r["engines"]]
        first = entries[0]
        if "version" not in first or "status" in first:
            lines.append(f"| {name} | {first['status']} |" + " |" * 5)
            continue
        results = {kind: [e["workloads"][kind] for e in entries] for kind in first["workloads"]}
        builds = [r.get("tokenizer_build_s") for rs in results.values() for r in rs]
        requires = ", ".join(
            f"{q['requirement']} ({_cell([q['installed_mb']])})" for q in first["requires"]
        )
        lines.append(
            f"| {name} | {first['version']} | {_number(first['installed_mb'])} | "
            f"{requires or 'none'} | {_cell(builds)} | {first['rollback_api']} | "
            f"{first['block_api']} |"
        )
        for kind, rs in results.items():
            statuses = [r["status"] for r in rs]
            if set(statuses) != {OK}:
                rows.append(f"| {name} | {kind} | {_status_cell(statuses)} |" + " |" * 13)
            else:
                cells = [_cell([r.get(key) for r in rs]) for _, key in WORKLOAD_COLUMNS]
                rows.append(f"| {name} | {kind} | " + " | ".join(cells) + " |")
    header = " | ".join(title for title, _ in WORKLOAD_COLUMNS)
    lines += ["", f"| engine | workload | {header} |", "|---" * (len(WORKLOAD_COLUMNS) + 2) + "|"]
    return "\n".join(lines + rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", help="a Hugging Face tokenizer folder")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--vocab-size", type=int, default=0, help="mask width (default: all ids)")
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S)
    parser.add_argument("--json", type=Path, help="write the full report here")
    parser.add_argument("--summarize", type=Path, nargs="+", help="reports to table, no runs")
    parser.add_argument("--child", nargs=2, metavar=("ENGINE", "WORKLOAD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    if args.summarize:
        print(render([json.loads(path.read_text()) for path in args.summarize]))
        return
    if not args.tokenizer:
        parser.error("--tokenizer is needed to measure")
    report = run(args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(render([report]))


if __name__ == "__main__":
    main()
