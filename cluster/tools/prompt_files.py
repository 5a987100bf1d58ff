"""The prompt files the measuring commands read: JSON lines, one object per line, packaged under
`cluster/tools/prompts/` (the default) or given by path.

`load_prompts` reads the bench's kind (`prompt`, optional `category`); `prompt_rows` is the
line reader under it, for files of other fields. InvalidArgumentError for an unreadable file, a
line that is not a JSON object or lacks `prompt`, or no prompt at all.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from cluster.runtime.errors import InvalidArgumentError


@dataclass(frozen=True)
class Prompt:
    text: str
    category: str


def prompt_rows(path: str | None, default: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line of the JSON-lines file `path` (None: the
    packaged `default`, relative to `cluster.tools`); InvalidArgumentError for an unreadable
    file or a line that is not a JSON object."""
    if path is None:
        text = resources.files("cluster.tools").joinpath(default).read_text()
    else:
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise InvalidArgumentError(f"cannot read prompts {path}: {error}") from error
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as error:
            raise InvalidArgumentError(f"prompts line {number}: {error}") from error
        if not isinstance(row, dict):
            raise InvalidArgumentError(f"prompts line {number}: not a JSON object")
        yield number, row


def load_prompts(path: str | None) -> list[Prompt]:
    prompts = []
    for number, row in prompt_rows(path, "prompts/default.jsonl"):
        try:
            prompts.append(Prompt(str(row["prompt"]), str(row.get("category", "default"))))
        except KeyError as error:
            raise InvalidArgumentError(f"prompts line {number}: {error}") from error
    if not prompts:
        raise InvalidArgumentError("no prompts to run")
    return prompts
