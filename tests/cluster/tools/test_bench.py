"""`tandem bench` on the tiny pair: every field later checks read, a chart, and bad input."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.cli import service as cli_service
from cluster.cli.main import main
from cluster.cli.serve_flags import config_from_flags
from cluster.tools.bench.settings import bench_settings, serve_flags
from cluster.tools.bench.summary import RUNS
from cluster.tools.prompt_files import load_prompts

PROMPTS = [
    {"prompt": "def add(a, b):", "category": "code"},
    {"prompt": "Once upon a time", "category": "creative"},
]


def test_default_prompts_cover_the_categories() -> None:
    prompts = load_prompts(None)
    assert {p.category for p in prompts} == {"code", "structured", "prose", "creative"}
    assert all(p.text for p in prompts)


@pytest.mark.parametrize("subset", ["code-and-prose", "one-per-category"])
def test_prompt_subsets_are_taken_from_the_default_set(subset: str) -> None:
    """The quicker sets the speed measurements use are prompts of the default set."""
    folder = Path(__file__).resolve().parents[3] / "cluster" / "tools" / "prompts"
    chosen = load_prompts(str(folder / f"{subset}.jsonl"))
    assert chosen and set(chosen) <= set(load_prompts(None))


def test_bad_prompt_files(tmp_path: Path) -> None:
    from cluster.runtime.errors import InvalidArgumentError

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"category": "code"}\n')
    with pytest.raises(InvalidArgumentError, match="line 1"):
        load_prompts(str(bad))
    with pytest.raises(InvalidArgumentError, match="cannot read prompts"):
        load_prompts(str(tmp_path / "absent.jsonl"))


@pytest.mark.slow
@pytest.mark.parametrize("adaptive", [False, True])
def test_local_bench_writes_result_and_chart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], adaptive: bool
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out, chart = tmp_path / "out.json", tmp_path / "out.png"
    code = main(["bench", "--preset", "tiny", "--prompts", str(prompts), "--max-tokens", "12",
                 "--repeats", "3", "--json", str(out), "--plot", str(chart),
                 "--prompt-lookup", "--adaptive-draft" if adaptive else "--no-adaptive-draft",
                 "--draft-forms"])  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    assert list(result["runs"]) == list(RUNS)
    for run in result["runs"].values():
        assert run["tokens_per_s"] > 0 and run["ms_per_token"] > 0
    pipelined = result["runs"]["tandem_pipelined"]
    for key in ("acceptance_rate", "mean_tokens_per_verify", "acceptance_by_position",
                "pipeline_hit_rate", "ideal_speedup"):  # fmt: skip
        assert key in pipelined
    if adaptive:
        # The tiny draft costs about what its target does, so the chosen plans may never
        # speculate: then nothing was drafted and there is no acceptance to report.
        rate = pipelined["acceptance_rate"]
        assert rate is None or 0 <= rate <= 1
        assert pipelined["mean_tokens_per_verify"] >= 1
    else:
        assert 0 < pipelined["acceptance_rate"] < 1
    assert result["runs"]["tandem_target"]["mean_tokens_per_verify"] == 1.0
    assert set(result["speedup"]) == {"vs_hf_target", "vs_hf_assisted", "vs_tandem_target",
                                      "pipelining"}  # fmt: skip
    assert result["greedy_match"] == {"matched": 2, "total": 2}
    assert result["config"]["prompt_lookup"] is True
    assert result["config"]["adaptive_draft"] is adaptive
    assert result["config"]["settings"]["draft_quantization"] == "none"  # the tiny preset's
    forms = result["draft_forms"]
    assert {(f["quantization"], f["vocab"]) for f in forms} >= {("none", "full"), ("int8", "full")}
    for form in forms:
        assert form["ms_per_token"] > 0 and 0 <= form["agreement"]["all"] <= 1
        assert set(form["agreement"]) == {"code", "creative", "all"}
    assert set(result["by_category"]) == {"code", "creative"}
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "greedy match (fp32): 2/2 prompts" in capsys.readouterr().out


def test_too_few_repeats_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--repeats", "2"]) == 2
    assert "--repeats must be >= 3" in capsys.readouterr().err


def test_serve_config_needs_service_mode(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--serve-config", "deploy/tandem.yaml"]) == 2
    assert "--serve-config needs --mode service" in capsys.readouterr().err


@pytest.mark.parametrize("lookup", [False, True])
def test_the_benched_service_gets_each_setting_as_asked(lookup: bool) -> None:
    """The service turns both router features on by default: a bench run without them must
    say so; the draft's form is stated too."""
    settings = {"prompt_lookup": lookup, "adaptive_draft": False, "suffix_drafter": False,
                "draft_quantization": "int8-dynamic", "draft_vocab": 4096}  # fmt: skip
    flags = serve_flags(SimpleNamespace(serve_config=None), settings)
    assert ("--prompt-lookup" in flags) is lookup and ("--no-prompt-lookup" in flags) is not lookup
    assert "--no-adaptive-draft" in flags and "--no-suffix-drafter" in flags
    parser = argparse.ArgumentParser()
    cli_service.add_to(parser.add_subparsers())
    config = config_from_flags(parser.parse_args(["serve", *flags]))
    assert config.prompt_lookup.enabled is lookup and not config.draft_length.enabled
    assert not config.suffix_drafter.enabled
    assert config.pair().draft.quantization == "int8-dynamic"
    assert config.pair().draft.trimmed_vocab == 4096


def test_without_flags_the_bench_runs_the_service_defaults() -> None:
    """`tandem bench --mode service` measures what `tandem serve` runs: prompt lookup, the
    adaptive plan and the preset's draft, with threads fitted to the machine."""
    parser = argparse.ArgumentParser()
    from cluster.cli import bench as cli_bench

    cli_bench.add_to(parser.add_subparsers())
    args = parser.parse_args(["bench", "--preset", "qwen-coder", "--mode", "service"])
    settings = bench_settings(args)
    assert settings["prompt_lookup"] is True and settings["adaptive_draft"] is True
    assert settings["draft_quantization"] == "int8"
    assert settings["verifier_threads"] == settings["drafter_threads"] >= 1
    # Service tenants cannot be told apart per repeat: the suffix drafter is benched in process.
    assert settings["suffix_drafter"] is False
    assert bench_settings(parser.parse_args(["bench"]))["suffix_drafter"] is True  # on
    local = parser.parse_args(["bench", "--preset", "qwen-coder", "--no-suffix-drafter"])
    assert bench_settings(local)["suffix_drafter"] is False
    service = parser.parse_args(["bench", "--mode", "service", "--suffix-drafter"])
    assert bench_settings(service)["suffix_drafter"] is False
    off = parser.parse_args(["bench", "--mode", "service", "--no-prompt-lookup",
                             "--draft-quantization", "none", "--draft-vocab", "0"])  # fmt: skip
    settings = bench_settings(off)
    assert settings["prompt_lookup"] is False and settings["adaptive_draft"] is True
    assert settings["draft_quantization"] == "none" and settings["draft_vocab"] == 0
