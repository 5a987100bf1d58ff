"""A `tandem loadtest` result read: its goals, its Markdown table and its chart.

`RUN_MODES` are the modes a level may run, in the order tables and plots show them, then
`HF_MODE` (`hf_target_batched`: Hugging Face serving the target alone, batched). `goals` gives
per level speculative's tokens/s over target_only's and over hf_target_batched's, and
speculative at 8 streams over 1 when both levels ran. `format_table` writes a row per level and
mode with the level's speedups; with a sim preset, each mode's ideal tokens/s and achieved/ideal
("–": unbounded, or no ideal for the mode; the ideal takes the draft's greedy agreement alpha as
the acceptance, so sampled runs accept differently); with replica traffic, the verifiers' step
occupancy; then CPU ms per generated token by process role. `plot` draws aggregate tokens/s
(each ideal dashed) and the speedup of speculative against concurrency. Pure but for the PNG
`plot` writes; matplotlib (the `plot` extra) is imported inside it.
"""

from __future__ import annotations

import math
from typing import Any

HF_MODE = "hf_target_batched"

RUN_MODES = ("speculative", "serial", "predrafted", "target_only")
"""Every mode a load test may run, in the order tables and plots show them."""


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def goals(levels: list[dict[str, Any]]) -> dict[str, Any]:
    """Per level, speculative's tokens/s over target_only's and over hf_target_batched's; and
    speculative at 8 streams over speculative at 1, when both levels ran."""
    rate = {lv["concurrency"]: lv["speculative"]["tokens_per_s"] for lv in levels}
    per_level = []
    for level in levels:
        ratios: dict[str, Any] = {"concurrency": level["concurrency"]}
        for mode in ("target_only", HF_MODE):
            if mode in level:
                ratios[f"speculative_over_{mode}"] = _ratio(
                    level["speculative"]["tokens_per_s"], level[mode]["tokens_per_s"]
                )
        per_level.append(ratios)
    scaling = _ratio(rate[8], rate[1]) if 1 in rate and 8 in rate else None
    return {"speculative_8_over_1": scaling, "levels": per_level}


def ideal_text(ideal: dict[str, float | None], mode: str) -> str:
    """`mode`'s ideal tokens/s in words, for a progress line."""
    value = ideal[f"{mode}_tokens_per_s"]
    return "unbounded: the device costs nothing" if value is None else f"{value:.2f} tokens/s"


def fixed(value: float | None, digits: int = 2) -> str:
    """A number to `digits` places; "–" for None (an unbounded ideal, or no ratio)."""
    return "–" if value is None else f"{value:.{digits}f}"


def format_table(result: dict[str, Any]) -> str:
    """Markdown: a row per level and mode, then the level's speedups; with a sim preset, each
    mode's ideal tokens/s and achieved/ideal ("–": unbounded, or no ideal for the mode); then
    CPU ms per generated token by process role, a row per level and mode."""
    from cluster.tools.bench.cpu_table import cpu_section

    with_ideal = any("ideal" in level for level in result["levels"])
    with_occupancy = any(
        _occupancy(level[mode]) is not None
        for level in result["levels"]
        for mode in RUN_MODES
        if mode in level
    )
    header = ["concurrency", "mode", "tokens/s", "requests", "TTFT p50 ms", "ITL p50 ms",
              "errors", *(["ideal tokens/s", "achieved/ideal"] if with_ideal else []),
              *(["step occupancy", "running per step"] if with_occupancy else [])]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def row(*cells: str) -> str:
        return "| " + " | ".join([*cells, *[""] * (len(header) - len(cells))]) + " |"

    for level in result["levels"]:
        concurrency = str(level["concurrency"])
        for mode in (*RUN_MODES, HF_MODE):
            if mode not in level:
                continue
            run = level[mode]
            ttft, itl = run["ttft_ms"]["p50"], run["itl_ms"]["p50"]
            cells = [concurrency, mode, f"{run['tokens_per_s']:.2f}", str(run["requests"]),
                     fixed(ttft, 0), fixed(itl, 0),
                     str(sum(run["errors"].values())) if "errors" in run else "–"]  # fmt: skip
            if with_ideal:
                ideal = level.get("ideal", {}).get(f"{mode}_tokens_per_s")
                ratio = level.get("achieved_over_ideal", {}).get(mode)
                cells += [fixed(ideal), fixed(ratio)]
            if with_occupancy:
                verifier = run.get("replica_traffic", {}).get("verifier", {})
                cells += [fixed(verifier.get("occupancy"), 3),
                          fixed(verifier.get("running_per_step"), 1)]  # fmt: skip
            lines.append(row(*cells))
        if "speedup" in level:
            lines.append(row(concurrency, "speedup", f"{level['speedup']:.2f}x"))
        over_hf = goals([level])["levels"][0].get(f"speculative_over_{HF_MODE}")
        if over_hf is not None:
            lines.append(row(concurrency, "speedup vs HF", f"{over_hf:.2f}x"))
    sim = result.get("sim")
    if sim is not None:
        bounded = any(lv["ideal"]["speculative_tokens_per_s"] for lv in result["levels"])
        lines += [
            "",
            f"ideal: {sim['preset']} ({sim['target']} + {sim['draft']}), alpha "
            f"{sim['alpha']:.2f}, k {sim['draft_tokens']}, context {sim['context_tokens']:.1f} "
            f"tokens (prompts {sim['mean_prompt_tokens']:.1f} + half of max_tokens); "
            "speculative: the better of serial and pipelined"
            + ("" if bounded else "; –: unbounded, the simulated device costs nothing"),
        ]
    cpu_rows = [
        ((str(level["concurrency"]), mode), level[mode]["cpu_ms_per_token"])
        for level in result["levels"]
        for mode in RUN_MODES
        if "cpu_ms_per_token" in level.get(mode, {})
    ]
    lines += cpu_section(("concurrency", "mode"), cpu_rows, result.get("cpu_scope"))
    return "\n".join(lines) + "\n"


def _occupancy(run: dict[str, Any]) -> float | None:
    """The verifiers' step occupancy over a run (`replica_traffic`), if it was read."""
    verifier = run.get("replica_traffic", {}).get("verifier", {})
    occupancy: float | None = verifier.get("occupancy")
    return occupancy


def _ideal_series(levels: list[dict[str, Any]], mode: str) -> list[float] | None:
    """`mode`'s ideal tokens/s per level (NaN where unbounded); None if no level has one."""
    values = [lv.get("ideal", {}).get(f"{mode}_tokens_per_s") for lv in levels]
    if all(v is None for v in values):
        return None
    return [math.nan if v is None else float(v) for v in values]


def plot(result: dict[str, Any], path: str) -> None:
    from cluster.tools.bench.output import pyplot

    plt = pyplot()
    levels = result["levels"]
    concurrency = [level["concurrency"] for level in levels]
    fig, (rate_ax, speedup_ax) = plt.subplots(1, 2, figsize=(11.0, 4.0))
    try:
        for mode in (*RUN_MODES, HF_MODE):
            if all(mode in lv for lv in levels):
                (line,) = rate_ax.plot(concurrency, [lv[mode]["tokens_per_s"] for lv in levels],
                                       marker="o", label=mode)  # fmt: skip
                ideal = _ideal_series(levels, mode)
                if ideal is not None:
                    rate_ax.plot(concurrency, ideal, linestyle="--", color=line.get_color(),
                                 label=f"{mode} ideal")  # fmt: skip
        rate_ax.set_xlabel("concurrent streams")
        rate_ax.set_ylabel("aggregate tokens/s")
        rate_ax.legend()
        rate_ax.grid(alpha=0.3)
        speedup_ax.plot(concurrency, [lv["speedup"] for lv in levels], marker="o",
                        label="speculative / target_only")  # fmt: skip
        for mode in ("serial", "predrafted"):
            if all(mode in lv for lv in levels):
                speedup_ax.plot(
                    concurrency,
                    [lv[mode]["tokens_per_s"] / lv["target_only"]["tokens_per_s"] for lv in levels],
                    marker="^", label=f"{mode} / target_only",
                )  # fmt: skip
        speedup_ax.legend()
        with_hf = all(HF_MODE in lv for lv in levels)
        if with_hf:
            speedup_ax.plot(
                concurrency,
                [math.nan if (r := ratios[f"speculative_over_{HF_MODE}"]) is None else r
                 for ratios in goals(levels)["levels"]],
                marker="s", label=f"speculative / {HF_MODE}",
            )  # fmt: skip
            speedup_ax.legend()
        speedup_ax.axhline(1.0, color="gray", linestyle="--")
        speedup_ax.set_xlabel("concurrent streams")
        speedup_ax.set_ylabel("speedup of speculative" if with_hf else "speculative / target-only")
        speedup_ax.set_ylim(bottom=0)
        speedup_ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
