"""The demo's logic over a scripted client: what it streams, compares and reports."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from cluster.api.client_types import GenerateResult, RequestStats, StreamChunk
from cluster.tools.demo import WARMUP_TOKENS, format_report, run_demo

STATS = RequestStats(
    num_prompt_tokens=3,
    num_generated_tokens=6,
    num_drafted=8,
    num_accepted=6,
    num_verify_passes=2,
    pipeline_hits=1,
    pipeline_misses=0,
)


class ScriptedClient:
    """Streams `speculative` in two chunks; answers a draft-length-0 call with `alone`."""

    def __init__(self, speculative: tuple[int, ...], alone: tuple[int, ...]) -> None:
        self.speculative = speculative
        self.alone = alone
        self.calls: list[dict[str, Any]] = []

    def generate(self, prompt: str, **kwargs: Any) -> GenerateResult:
        self.calls.append({"stream": False, **kwargs})
        tokens = self.alone if kwargs.get("draft_tokens") == 0 else self.speculative
        return GenerateResult("r", tokens[: kwargs["max_tokens"]], "", "length", 3, 0, 0, 0, 0, 0)

    def stream(self, prompt: str, **kwargs: Any) -> Iterator[StreamChunk]:
        self.calls.append({"stream": True, **kwargs})
        yield StreamChunk("r", self.speculative[:4], "abcd")
        yield StreamChunk("r", self.speculative[4:], "ef", "length", STATS)


def test_streams_text_then_times_the_target_alone() -> None:
    client = ScriptedClient((1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 5, 6))
    written: list[str] = []
    report = run_demo(client, "p", 6, written.append)
    assert "".join(written) == "abcdef"
    assert [c["stream"] for c in client.calls] == [False, True, False]
    assert client.calls[0]["max_tokens"] == WARMUP_TOKENS
    assert client.calls[2]["draft_tokens"] == 0 and client.calls[2]["temperature"] == 0.0
    assert report.same_tokens and report.num_same_leading_tokens == 6
    assert report.acceptance_rate == 0.75 and report.tokens_per_verify == 3.0
    assert report.pipeline_hit_rate == 1.0
    text = format_report(report)
    assert "acceptance 75% of 8 drafted, 3.00 tokens per verify pass" in text
    assert "same tokens as the target alone: yes" in text


def test_a_diverging_run_reports_the_shared_prefix() -> None:
    report = run_demo(ScriptedClient((1, 2, 3, 4, 5, 6), (1, 2, 3, 9, 9, 9)), "p", 6, print)
    assert not report.same_tokens and report.num_same_leading_tokens == 3
    assert "same tokens as the target alone: the first 3;" in format_report(report)


def test_speedup_is_the_ratio_of_token_rates() -> None:
    report = run_demo(ScriptedClient((1,) * 6, (1,) * 6), "p", 6, print)
    expected = (6 / report.speculative_s) / (6 / report.target_only_s)
    assert report.speedup == expected
