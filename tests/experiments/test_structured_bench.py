"""The structured-outputs bench on the tiny pair: its report, and constrained outputs that
validate. The tiny models write noise, so the schemas admit only short answers: a constrained
request then always completes its JSON, and ends (finish reason stop), well within max_tokens."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

import cluster.local
from cluster.local import build_local
from experiments.structured import (
    MODES,
    NOT_JSON,
    SCHEMA_MISMATCH,
    VALID,
    check_output,
    load_extraction_prompts,
    main,
    unfenced,
)

SHORT_SCHEMAS = [
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]}},
        "required": ["ok", "size"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
            "kind": {"type": "string", "enum": ["x", "y"]},
        },
        "required": ["tags", "kind"],
        "additionalProperties": False,
    },
]
MAX_TOKENS = 48
"""The longest answer either schema admits, `{"tags":["a","b"],"kind":"x"}`, is 29 bytes: one
token each in the tiny byte-level vocabulary."""


def test_bench_reports_each_mode_and_constrained_outputs_validate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bench's pair in lockstep (`verifier_advances` off): the in-process tiny drafter is no
    # faster than its verifier, so with running sessions its blocks mostly come after the
    # verifier took those tokens alone and are never posted; in lockstep every round posts
    # one, so the speculative mode's drafted count says that it speculated.
    monkeypatch.setattr(
        cluster.local, "build_local", functools.partial(build_local, verifier_advances=False)
    )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"category": f"c{i}", "prompt": "Extract it.", "schema": schema}) + "\n"
            for i, schema in enumerate(SHORT_SCHEMAS)
        )
    )
    out = tmp_path / "result.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--prompts", str(prompts), "--repeats", "1"]
    assert main([*argv, "--max-tokens", str(MAX_TOKENS), "--json", str(out)]) == 0

    result = json.loads(out.read_text())
    assert result["config"]["num_prompts"] == 2 and result["config"]["temperature"] == 0.0
    assert set(result["modes"]) == set(MODES)
    assert set(result["ratios"]) == {
        "constrained_spec_over_unconstrained_spec",
        "constrained_spec_over_constrained_target",
    }
    assert all(ratio > 0 for ratio in result["ratios"].values())
    records = result["requests"]
    assert sorted(r["mode"] for r in records) == sorted(MODES * 2)
    for record in records:
        schema = SHORT_SCHEMAS[int(record["category"][1:])]
        assert check_output(record["text"], schema) == record["verdict"]
        if record["mode"] == "unconstrained_spec":
            assert record["mask_rows"] == 0
            continue
        assert record["finish_reason"] == "stop" and record["verdict"] == VALID, record
        assert record["mask_rows"] >= record["tokens"]  # the verifier masks every position
    for mode in ("constrained_spec", "constrained_target"):
        summary = result["modes"][mode]
        assert summary["validity"] == 1.0 and summary["finish_reasons"] == {"stop": 2}
        assert summary["mask_compute_ms_per_row"] > 0
    assert result["modes"]["constrained_target"]["drafted"] == 0
    assert result["modes"]["constrained_spec"]["drafted"] > 0


def test_outputs_are_judged_whole() -> None:
    schema = SHORT_SCHEMAS[0]
    assert check_output('{"ok":true,"size":"m"}', schema) == VALID
    assert check_output('{"ok":true,"size":"xl"}', schema) == SCHEMA_MISMATCH
    fenced = '```json\n{"ok": false, "size": "s"}\n```'
    assert check_output(fenced, schema) == NOT_JSON
    assert check_output(unfenced(fenced), schema) == VALID


def test_shipped_prompts_load() -> None:
    prompts = load_extraction_prompts(None)
    assert len(prompts) == 10 and len({p.category for p in prompts}) == 10
    for prompt in prompts:
        assert 5 <= len(prompt.schema["properties"]) <= 10
        assert json.dumps(prompt.schema, separators=(",", ":")) in prompt.message()
