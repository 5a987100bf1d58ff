"""Render a `tandem bench` result as Markdown text and as a two-panel PNG.

Contract: both functions take the result dict that `cluster/tools/bench/run.py` produces, unchanged:
`config` (preset, mode, max_tokens, draft_tokens, dtype, repeats, num_prompts), `runs` (one
entry per run, in the order run; `tokens_per_s`, `ms_per_token`, `num_tokens`, plus the
Tandem-only fields `acceptance_rate`, `mean_tokens_per_verify`, `acceptance_by_position`,
`ideal_speedup` and, for `tandem_pipelined`, `pipeline_hit_rate`), `speedup`, `greedy_match`
and `by_category`. A field that is absent or None prints as MISSING; nothing is computed here
that the benchmark did not measure. Rendering only: no timing, no model, no I/O except the one
PNG that `plot` writes. matplotlib (the `plot` extra) is imported inside `plot`, so importing
this module stays cheap for the CLI and for tests that only need the text, and works without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cluster.tools.bench.cpu_table import cpu_section

# Printed in place of a value the run did not measure (HF runs have no acceptance rate).
MISSING = "–"

DRAFTER_KIND_COLUMNS = ("suffix_share", "suffix_acceptance_rate", "model_acceptance_rate")
"""Per category: the suffix drafter's share of drafted tokens, its acceptance, the model's."""
# The run whose throughput the per-category table reports: the full Tandem configuration.
CATEGORY_RUN = "tandem_pipelined"

FIGURE_SIZE_IN = (12.0, 4.5)
FIGURE_DPI = 120


def _number(value: float | None, spec: str, suffix: str = "") -> str:
    return MISSING if value is None else f"{value:{spec}}{suffix}"


def _percent(value: float | None) -> str:
    return MISSING if value is None else f"{100.0 * value:.1f}%"


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    # Pad every column to its widest cell so the raw text reads as well as the rendered table.
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return [line(header), rule, *(line(row) for row in rows)]


def format_table(result: dict[str, Any]) -> str:
    """Markdown: a table of runs, the speedup and greedy-match lines, a table of categories."""
    run_rows = [
        [
            name,
            _number(run.get("tokens_per_s"), ".1f"),
            _number(run.get("ms_per_token"), ".2f"),
            _percent(run.get("acceptance_rate")),
            _number(run.get("mean_tokens_per_verify"), ".2f"),
            _percent(run.get("pipeline_hit_rate")),
            _number(run.get("ideal_speedup"), ".2f", "x"),
        ]
        for name, run in result["runs"].items()
    ]
    header = [
        "run",
        "tokens/s",
        "ms/token",
        "acceptance",
        "tokens/verify",
        "pipeline hits",
        "ideal speedup",
    ]
    lines = _markdown_table(header, run_rows)

    speedup = result["speedup"]
    lines += [
        "",
        "speedup: "
        f"{_number(speedup.get('vs_hf_target'), '.2f', 'x')} vs HF target, "
        f"{_number(speedup.get('vs_hf_assisted'), '.2f', 'x')} vs HF assisted, "
        f"{_number(speedup.get('vs_tandem_target'), '.2f', 'x')} vs Tandem target-only, "
        f"{_number(speedup.get('pipelining'), '.2f', 'x')} from pipelining",
    ]
    match = result["greedy_match"]
    lines.append(f"greedy match (fp32): {match['matched']}/{match['total']} prompts")

    settings = result.get("config", {}).get("settings")
    if settings:
        lines.append("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))

    runs = list(result["runs"])
    category_rows = [
        [category, _percent(stats.get("acceptance_rate"))]
        + [_percent(stats.get(key)) for key in DRAFTER_KIND_COLUMNS]
        + [_number(stats.get("tokens_per_s", {}).get(name), ".2f") for name in runs]
        for category, stats in result["by_category"].items()
    ]
    if category_rows:
        lines.append("")
        header = ["category", f"acceptance ({CATEGORY_RUN})", "suffix share", "suffix acc.",
                  "model acc.", *runs]  # fmt: skip
        lines += _markdown_table(header, category_rows)
    lines += _forms_table(result.get("draft_forms"))
    lines += runs_cpu_section(result)
    return "\n".join(lines) + "\n"


def runs_cpu_section(result: dict[str, Any]) -> list[str]:
    """--mode service: CPU ms per generated token by process role, a row per Tandem run."""
    rows = [((name,), run["cpu_ms_per_token"]) for name, run in result["runs"].items()
            if "cpu_ms_per_token" in run]  # fmt: skip
    return cpu_section(("run",), rows, result.get("cpu_scope"))


def _forms_table(forms: list[dict[str, Any]] | None) -> list[str]:
    """Draft precision x vocabulary: ms/token and greedy agreement per category."""
    if not forms:
        return []
    categories = [c for c in forms[0]["agreement"] if c != "all"] + ["all"]
    rows = [
        [form["quantization"], str(form["vocab"]), _number(form["ms_per_token"], ".1f")]
        + [_percent(form["agreement"].get(c)) for c in categories]
        for form in forms
    ]
    header = ["draft", "vocab", "ms/token", *(f"agree {c}" for c in categories)]
    return ["", *_markdown_table(header, rows)]


def plot(result: dict[str, Any], path: str | Path) -> None:
    """Write a PNG: tokens/s per run (left) and acceptance by draft position per category."""
    from cluster.tools.bench.output import pyplot

    plt = pyplot()

    config = result["config"]
    names = list(result["runs"])
    tokens_per_s = [float(result["runs"][name]["tokens_per_s"]) for name in names]

    fig, (throughput_ax, acceptance_ax) = plt.subplots(1, 2, figsize=FIGURE_SIZE_IN)
    try:
        bars = throughput_ax.bar(range(len(names)), tokens_per_s, color="tab:blue")
        throughput_ax.bar_label(bars, labels=[f"{v:.1f}" for v in tokens_per_s], padding=2)
        throughput_ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
        throughput_ax.set_ylabel("tokens/s")
        # Headroom so the value labels above the tallest bar stay inside the axes.
        throughput_ax.set_ylim(0, max([*tokens_per_s, 1e-9]) * 1.15)
        throughput_ax.set_title(
            f"Throughput: {config['preset']}, {config['dtype']}, max_tokens={config['max_tokens']}"
        )

        max_positions = 0
        for category, stats in result["by_category"].items():
            by_position = stats.get("acceptance_by_position") or []
            if not by_position:
                continue
            positions = range(1, len(by_position) + 1)
            acceptance_ax.plot(positions, by_position, marker="o", label=category)
            max_positions = max(max_positions, len(by_position))
        acceptance_ax.set_xlabel("draft position")
        acceptance_ax.set_ylabel("fraction accepted")
        acceptance_ax.set_ylim(0.0, 1.0)
        if max_positions:
            acceptance_ax.set_xticks(range(1, max_positions + 1))
            acceptance_ax.legend()
        acceptance_ax.grid(alpha=0.3)
        acceptance_ax.set_title("Acceptance by draft position")

        fig.tight_layout()
        fig.savefig(path, dpi=FIGURE_DPI)
    finally:
        plt.close(fig)
