"""How the measuring commands (`tandem bench`, `tandem loadtest`) hand back a result: the
JSON file and the chart when asked for, and the table on stdout."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Result = dict[str, Any]


def write_result(
    result: Result,
    json_out: str | None,
    plot_out: str | None,
    plot: Callable[[Result, str], None],
    format_table: Callable[[Result], str],
) -> None:
    if json_out:
        Path(json_out).write_text(json.dumps(result, indent=2) + "\n")
    if plot_out:
        plot(result, plot_out)
    print(format_table(result))
