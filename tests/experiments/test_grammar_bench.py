"""grammar_bench: llguidance's path, in-process, over the tiny byte tokenizer (257 ids).

The walk is the workload's own valid output, so every token must be allowed and the end token
allowed after the last; rollback and the native k + 1 block call are checked against the plain
loop at every position.
"""

from __future__ import annotations

import pytest

from cluster.runtime.tiny import VOCAB_SIZE, build_tokenizer
from experiments.grammar.bench import render
from experiments.grammar.engines import engine
from experiments.grammar.measure import OK, measure
from experiments.grammar.workloads import JSON_SCHEMA, LARK, REGEX, WORKLOADS


@pytest.mark.parametrize("kind", [JSON_SCHEMA, REGEX, LARK])
def test_llguidance_walks_each_workload(kind: str) -> None:
    report = measure(engine("llguidance"), build_tokenizer(), VOCAB_SIZE, WORKLOADS[kind])
    assert report.status == OK
    assert report.walk_tokens == len(WORKLOADS[kind].text.encode())  # one token per byte
    assert report.tokenizer_build_s is not None and report.tokenizer_build_s > 0
    assert report.compile_s is not None and report.compile_s > 0
    for mask_us in (report.first_mask_us, report.mask_median_us, report.mask_p90_us):
        assert mask_us is not None and mask_us > 0
    assert report.end_allowed is True
    assert report.rollback_verified is True
    assert report.native_block_matches is True
    assert report.block_median_us is not None and report.block_median_us > 0


def test_summary_table_has_a_row_per_engine_and_workload() -> None:
    report = measure(engine("llguidance"), build_tokenizer(), VOCAB_SIZE, WORKLOADS[REGEX])
    run = {
        "engines": {
            "llguidance": {
                "version": "1.9.1",
                "installed_mb": 7.4,
                "requires": [],
                "rollback_api": "LLMatcher.rollback(n)",
                "block_api": "LLExecutor.unsafe_compute_mask_ptr_with_draft_token",
                "workloads": {REGEX: vars(report) | {"vocab_size": VOCAB_SIZE}},
            },
            "xgrammar": {"status": "skipped: not installed"},
        }
    }
    lines = render([run, run]).splitlines()
    assert any(line.startswith("| llguidance | 1.9.1 |") for line in lines)
    assert any(line.startswith("| xgrammar | skipped: not installed |") for line in lines)
    header = next(line for line in lines if line.startswith("| engine | workload |"))
    row = next(line for line in lines if line.startswith(f"| llguidance | {REGEX} |"))
    assert row.count("|") == header.count("|")
    assert "| yes |" in row
