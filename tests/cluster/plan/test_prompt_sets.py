"""The categorised prompt sets the plan's categories come from: each loads as the bench reads
it, holds its own category, and an agentic session's turns come in order."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import pytest

from cluster.plan.defaults import CATEGORIES, PRESETS
from cluster.tools.prompt_files import load_prompts

FILES = {
    "agentic-edit.jsonl": {"agentic"},
    "summarise-quote.jsonl": {"summarise"},
    "reasoning-long.jsonl": {"reasoning"},
    "categories-mix.jsonl": set(CATEGORIES),
}


def rows(name: str) -> list[dict[str, Any]]:
    text = resources.files("cluster.tools").joinpath(f"prompts/{name}").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize(("name", "categories"), FILES.items())
def test_each_set_loads_with_its_categories(name: str, categories: set[str]) -> None:
    path = str(resources.files("cluster.tools").joinpath(f"prompts/{name}"))
    assert {p.category for p in load_prompts(path)} == categories


def test_agentic_sessions_come_in_turn_order_and_end_in_an_open_fence() -> None:
    sessions: dict[str, list[int]] = {}
    for row in rows("agentic-edit.jsonl"):
        sessions.setdefault(row["session"], []).append(row["turn"])
        # The answer starts inside the fence: the model writes the whole file back.
        assert row["prompt"].rstrip().endswith(("```python", "```javascript"))
    assert len(sessions) == 4
    assert all(
        turns == list(range(1, len(turns) + 1)) and len(turns) >= 3 for turns in sessions.values()
    )


def test_every_preset_plans_every_category() -> None:
    for inputs in PRESETS.values():
        assert set(inputs.acceptance) == set(CATEGORIES)
