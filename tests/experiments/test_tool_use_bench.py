"""The tool-use bench (`experiments.tool_use`) on the tiny pair: it runs and reports every
mode, reads outputs as the API does, and the shipped prompts' tools compile as "auto" grammars.
The tiny models write noise and never choose a call (tests/cluster/tool_seams.py), so here the
call rate is what it is; the qwen-coder run (docs/structured-outputs.md) measures it."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance.hf

from cluster.api.tool_format_hermes import HermesFormat
from cluster.runtime import tiny
from cluster.runtime.constraint import Grammar, check_grammar
from experiments.tool_use import MODES, judge_calls, load_tool_prompts, main

SHIPPED = Path(__file__).parents[2] / "cluster" / "tools" / "prompts" / "tool-use-10.jsonl"


def test_bench_reports_each_mode_on_the_tiny_pair(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(SHIPPED.read_text().splitlines(keepends=True)[:2]))
    out = tmp_path / "result.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--prompts", str(prompts), "--repeats", "1"]
    assert main([*argv, "--max-tokens", "24", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["tool_parser"] == "hermes" and result["config"]["num_prompts"] == 2
    assert set(result["modes"]) == set(MODES)
    assert sorted(r["mode"] for r in result["requests"]) == sorted(MODES * 2)
    for mode, summary in result["modes"].items():
        assert summary["requests"] == 2 and summary["tokens_per_s"] > 0
        # The speculative modes run the adaptive plan, which may price drafts down to none on a
        # busy machine; the target alone never drafts.
        assert summary["drafted"] == 0 or mode != "auto_target"
        assert (summary["mask_compute_ms_per_token"] > 0) == (mode != "free_spec")
    for record in result["requests"]:
        assert record["valid_calls"] <= record["calls"]
        if record["mode"] != "free_spec":  # the grammar: text never holds a stray tag
            assert "<tool_call>" not in record["text"] or record["calls"]
    assert all(ratio > 0 for ratio in result["ratios"].values())


def test_calls_are_judged_by_name_and_schema() -> None:
    schemas = {"f": {"type": "object", "properties": {"a": {"type": "integer"}},
                     "required": ["a"]}}  # fmt: skip
    calls = [
        {"function": {"name": "f", "arguments": '{"a": 1}'}},
        {"function": {"name": "f", "arguments": '{"a": "x"}'}},
        {"function": {"name": "g", "arguments": "{}"}},
        {"function": {"name": "f", "arguments": '{"a": '}},
    ]
    assert judge_calls(calls, schemas) == 1


def test_shipped_prompts_load_and_compile_as_auto_grammars() -> None:
    prompts = load_tool_prompts(None)
    assert len(prompts) == 10 and all(2 <= len(p.tools) <= 3 for p in prompts)
    tokenizer = tiny.build_tokenizer()
    view = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[256])
    for prompt in prompts:
        source = HermesFormat().grammar([t["function"] for t in prompt.tools], True)
        check_grammar(Grammar("lark", source), view)
