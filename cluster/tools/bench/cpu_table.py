"""CPU per generated token by process role, as the measuring commands print it.

`cpu_table` is a Markdown table, a row per window, a column per role (`ROLES`, then
`service_total` and `load_client`); `cpu_section` is that table under a title naming the scope,
as lines to append to a printed result (none without a row); `cpu_line` is one line for a
progress message. "–" where there is no figure (no token generated). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cluster.tools.bench.process_roles import CLIENT, ROLES, SERVICE_TOTAL

TABLE_COLUMNS = (*ROLES, SERVICE_TOTAL, CLIENT)


CpuRow = tuple[Sequence[str], Mapping[str, Any]]


def cpu_table(labels: Sequence[str], rows: Sequence[CpuRow]) -> str:
    """Markdown: CPU ms per generated token by role, a row per window; `labels` name the leading
    cells each row brings (`rows`: (those cells, its `cpu_ms_per_token`))."""
    header = [*labels, *TABLE_COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cells, per_token in rows:
        figures = [_ms(per_token.get(role)) for role in TABLE_COLUMNS]
        lines.append("| " + " | ".join([*cells, *figures]) + " |")
    return "\n".join(lines) + "\n"


def cpu_section(labels: Sequence[str], rows: Sequence[CpuRow], scope: str | None) -> list[str]:
    """`cpu_table` under a title naming the scope, as lines to append to a printed result;
    nothing when there is no row."""
    if not rows:
        return []
    title = f"CPU ms per generated token, by process role ({scope}):"
    return ["", title, "", cpu_table(labels, rows).rstrip("\n")]


def cpu_line(per_token: Mapping[str, Any]) -> str:
    """One line for a progress message: the service's total, its roles busiest first (those
    above 0.005 ms), and the load client's."""
    roles = sorted((r for r in ROLES if (per_token.get(r) or 0) >= 0.005),
                   key=lambda r: -per_token[r])  # fmt: skip
    parts = ", ".join(f"{role} {per_token[role]:.2f}" for role in roles)
    return (f"CPU ms/token: service {_ms(per_token.get(SERVICE_TOTAL))} ({parts}), "
            f"load client {_ms(per_token.get(CLIENT))}")  # fmt: skip


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"
