"""`tandem loadtest --preset sim-...`: the ideal of every level beside what was achieved.

The arithmetic (`cluster.tools.bench.loadtest_ideal`) against hand-worked figures; the table,
JSON and plot on fabricated results and on a fake service (no Ray, no timed assertions)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from matplotlib.figure import Figure

from cluster.api.client_types import StreamChunk
from cluster.cli.loadtest_levels import run_modes
from cluster.cli.loadtest_report import format_table, plot
from cluster.cli.main import main
from cluster.presets import PRESETS, resolve_pair
from cluster.routing.draft_length_config import DEFAULT_DRAFT_TOKENS
from cluster.runtime import sim, sim_source
from cluster.runtime.limits import MAX_PREDRAFT_FAN_OUT
from cluster.runtime.models import load_tokenizer
from cluster.tools.bench.loadtest_ideal import SimIdeal, achieved_over_ideal, ideal_of_level
from cluster.tools.bench.process_roles import CLIENT, ROLES, SERVICE_TOTAL
from cluster.tools.prompt_files import load_prompts
from tests.cluster.tools.load_fakes import as_async

CPU_KEYS = (*ROLES, SERVICE_TOTAL, CLIENT)

H100_8B = PRESETS["sim-h100-8b"]
INSTANT = PRESETS["sim-instant"]


def h100_ideal(draft_tokens: int = 4) -> SimIdeal:
    # Prompts of 40 and 60 tokens, 100 new tokens: a mean context of 50 + 100 / 2 = 100.
    return SimIdeal.from_sources(
        "sim-h100-8b", H100_8B.target, H100_8B.draft, draft_tokens, [40, 60], max_tokens=100
    )


def test_the_ideal_takes_alpha_from_the_draft_and_the_mean_context() -> None:
    ideal = h100_ideal()
    assert ideal.alpha == 0.8 and ideal.draft_tokens == 4
    assert ideal.mean_prompt_tokens == 50.0 and ideal.context_tokens == 100.0
    a06 = PRESETS["sim-h100-8b-a06"]
    assert SimIdeal.from_sources("x", a06.target, a06.draft, 4, [1], 2).alpha == 0.6
    assert ideal.describe() == {
        "preset": "sim-h100-8b", "target": "sim://target/h100-8b?vocab=4096",
        "draft": "sim://draft/a10g-0.5b?alpha=0.8&vocab=4096", "alpha": 0.8, "draft_tokens": 4,
        "mean_prompt_tokens": 50.0, "context_tokens": 100.0,
    }  # fmt: skip
    with pytest.raises(ValueError, match="starts with sim://"):
        SimIdeal.from_sources("tiny", "some/model", "other/model", 4, [1], 2)
    with pytest.raises(ValueError, match="no prompts"):
        SimIdeal.from_sources("x", H100_8B.target, H100_8B.draft, 4, [], 2)


def test_one_stream_by_hand() -> None:
    level = h100_ideal().level(1)
    # Target (h100-8b): 6.3 ms + 0.03 ms a token + 0.04 us a token attended (100).
    decode_s = 6.3e-3 + 3e-5 + 4e-8 * 100
    verify_s = 6.3e-3 + 5 * 3e-5 + 4e-8 * 100  # k + 1 = 5 tokens
    block_s = 4 * (1.5e-3 + 1e-5 + 2e-8 * 100)  # four a10g-0.5b draft steps
    per_verify = (1 - 0.8**5) / (1 - 0.8)  # 3.3616
    hit = 0.8**4
    pipelined = (hit * 4 + per_verify - hit * 5) / (
        hit * max(verify_s, block_s) + (1 - hit) * (block_s + verify_s)
    )
    assert level["target_only_tokens_per_s"] == pytest.approx(1 / decode_s)
    assert level["serial_tokens_per_s"] == pytest.approx(per_verify / (block_s + verify_s))
    assert level["pipelined_tokens_per_s"] == pytest.approx(pipelined)
    assert level["tokens_per_verify"] == pytest.approx(per_verify)
    # Here pipelining wins: the speculative ideal is the better of the two.
    assert level["speculative_tokens_per_s"] == pytest.approx(pipelined)
    assert pipelined > per_verify / (block_s + verify_s)


@pytest.mark.parametrize("streams", [1, 4, 16, 64])
@pytest.mark.parametrize("draft_tokens", [0, 2, 4, 8])
def test_every_level_is_sim_ideal_rates_at_its_streams(streams: int, draft_tokens: int) -> None:
    level = h100_ideal(draft_tokens).level(streams)
    target = sim_source.SimSource.parse(H100_8B.target)
    draft = sim_source.SimSource.parse(H100_8B.draft)
    rates = sim.ideal_rates(target.profile, draft.profile, 0.8, draft_tokens, streams, 100)
    assert level["speculative_tokens_per_s"] == max(rates.serial, rates.pipelined)
    assert level["serial_tokens_per_s"] == rates.serial
    assert level["pipelined_tokens_per_s"] == rates.pipelined
    assert level["target_only_tokens_per_s"] == rates.target_only
    # Pre-drafting's ideal is never below the rounds it may fall back to.
    assert level["predrafted_tokens_per_s"] == max(rates.serial, rates.pipelined, rates.predrafted)
    assert level["predraft_fan_out"] == rates.predraft_fan_out
    if draft_tokens == 0:  # no drafting: speculation is the target alone
        assert level["speculative_tokens_per_s"] == pytest.approx(rates.target_only)


def test_a_device_that_costs_nothing_has_no_finite_ideal() -> None:
    ideal = SimIdeal.from_sources("sim-instant", INSTANT.target, INSTANT.draft, 4, [10], 8)
    assert set(ideal.level(8).values()) == {None}
    level = {"concurrency": 8, "speculative": {"tokens_per_s": 900.0},
             "target_only": {"tokens_per_s": 500.0}}  # fmt: skip
    assert ideal_of_level(ideal, level)["achieved_over_ideal"] == {
        "speculative": None,
        "target_only": None,
    }


def test_achieved_over_ideal() -> None:
    assert achieved_over_ideal(50.0, 200.0) == 0.25
    assert achieved_over_ideal(50.0, None) is None
    assert achieved_over_ideal(50.0, 0.0) is None


def fabricated_level(concurrency: int, speculative: float, target_only: float | None) -> dict:
    def run(rate: float) -> dict[str, Any]:
        return {"concurrency": concurrency, "tokens_per_s": rate, "requests": 10,
                "ttft_ms": {"p50": 12.0, "p99": 30.0}, "itl_ms": {"p50": 4.0, "p99": 9.0},
                "errors": {}, "lost": 0, "corrupted": 0}  # fmt: skip

    level: dict[str, Any] = {"concurrency": concurrency, "speculative": run(speculative)}
    if target_only is not None:
        level["target_only"] = run(target_only)
        level["speedup"] = speculative / target_only
    return level


def fabricated_result(with_target_only: bool = True) -> dict[str, Any]:
    ideal = h100_ideal()
    levels = [
        fabricated_level(c, 200.0 * c, 120.0 * c if with_target_only else None) for c in (1, 4)
    ]
    for level in levels:
        level.update(ideal_of_level(ideal, level))
    return {"levels": levels, "sim": ideal.describe()}


def test_each_level_gains_its_ideal_and_ratios_for_the_modes_it_ran() -> None:
    ideal = h100_ideal()
    result = fabricated_result()
    for level in result["levels"]:
        expected = ideal.level(level["concurrency"])
        assert level["ideal"] == expected
        assert set(level["achieved_over_ideal"]) == {"speculative", "target_only"}
        for mode in ("speculative", "target_only"):
            assert level["achieved_over_ideal"][mode] == pytest.approx(
                level[mode]["tokens_per_s"] / expected[f"{mode}_tokens_per_s"]
            )
    alone = fabricated_result(with_target_only=False)["levels"][0]
    assert set(alone["achieved_over_ideal"]) == {"speculative"}


def test_the_table_puts_the_ideal_beside_each_mode() -> None:
    result = fabricated_result()
    lines = format_table(result).splitlines()
    assert lines[0].endswith("| errors | ideal tokens/s | achieved/ideal |")
    width = lines[0].count("|")
    rows = [line for line in lines if line.startswith("| ")]
    assert all(line.count("|") == width for line in rows)  # speedup rows too
    level = result["levels"][1]
    ideal = level["ideal"]["speculative_tokens_per_s"]
    ratio = level["achieved_over_ideal"]["speculative"]
    assert f"| 4 | speculative | 800.00 | 10 | 12 | 4 | 0 | {ideal:.2f} | {ratio:.2f} |" in lines
    assert any(line.startswith("| 4 | target_only | 480.00 |") for line in lines)
    assert "| 4 | speedup | 1.67x |" in format_table(result)
    assert lines[-1].startswith("ideal: sim-h100-8b (sim://target/h100-8b?vocab=4096 + ")
    assert "alpha 0.80, k 4, context 100.0 tokens" in lines[-1]


def test_without_a_sim_preset_the_table_is_unchanged() -> None:
    result = {"levels": [fabricated_level(2, 300.0, 200.0)]}
    lines = format_table(result).splitlines()
    assert (
        lines[0]
        == "| concurrency | mode | tokens/s | requests | TTFT p50 ms | ITL p50 ms | errors |"
    )
    assert lines[2] == "| 2 | speculative | 300.00 | 10 | 12 | 4 | 0 |"
    assert lines[4] == "| 2 | speedup | 1.50x |  |  |  |  |"


def test_an_unbounded_ideal_prints_a_dash() -> None:
    ideal = SimIdeal.from_sources("sim-instant", INSTANT.target, INSTANT.draft, 4, [10], 8)
    level = fabricated_level(1, 500.0, 300.0)
    level.update(ideal_of_level(ideal, level))
    text = format_table({"levels": [level], "sim": ideal.describe()})
    assert "| 1 | speculative | 500.00 | 10 | 12 | 4 | 0 | – | – |" in text
    assert text.rstrip().endswith("–: unbounded, the simulated device costs nothing")
    assert "unbounded" not in format_table(fabricated_result())


def captured_plot(
    result: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[str, str, list[float]]]:
    """The rate axis's lines as (label, linestyle, y values), and the PNG written."""
    lines: list[tuple[str, str, list[float]]] = []
    save = Figure.savefig

    def savefig(figure: Figure, *args: Any, **kwargs: Any) -> None:
        lines.extend(
            (str(line.get_label()), str(line.get_linestyle()), list(line.get_ydata()))
            for line in figure.axes[0].get_lines()
        )
        save(figure, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    path = tmp_path / "plot.png"
    plot(result, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return lines


def test_the_plot_draws_each_ideal_dashed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result = fabricated_result()
    lines = {
        label: (style, ys) for label, style, ys in captured_plot(result, tmp_path, monkeypatch)
    }
    assert set(lines) == {"speculative", "target_only", "speculative ideal", "target_only ideal"}
    for mode in ("speculative", "target_only"):
        assert lines[mode] == ("-", [lv[mode]["tokens_per_s"] for lv in result["levels"]])
        style, ys = lines[f"{mode} ideal"]
        assert style == "--"
        assert ys == [lv["ideal"][f"{mode}_tokens_per_s"] for lv in result["levels"]]


def test_the_plot_has_no_ideal_lines_without_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = {"levels": [fabricated_level(c, 100.0 * c, 80.0 * c) for c in (1, 2)]}
    assert {label for label, _, _ in captured_plot(plain, tmp_path, monkeypatch)} == {
        "speculative",
        "target_only",
    }
    ideal = SimIdeal.from_sources("sim-instant", INSTANT.target, INSTANT.draft, 4, [10], 8)
    for level in plain["levels"]:
        level.update(ideal_of_level(ideal, level))  # unbounded: nothing to draw
    assert len(captured_plot(plain, tmp_path, monkeypatch)) == 2


class FakeService:
    """Streams eight tokens in two chunks, whatever the request: a service with no device."""

    def __init__(self, address: str, **options: Any) -> None:
        self.settings: list[dict[str, Any]] = []

    def __enter__(self) -> FakeService:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def generate(self, prompt: str, max_tokens: int, **settings: Any) -> SimpleNamespace:
        return SimpleNamespace(tokens=tuple(range(max_tokens)))

    def stream(self, prompt: str, max_tokens: int, **settings: Any) -> Iterator[StreamChunk]:
        tokens = tuple(range(max_tokens))
        time.sleep(0.001)  # a bounded number of requests in a level
        yield StreamChunk("r", tokens[:1], "")
        yield StreamChunk("r", tokens[1:], "", "length")


def test_loadtest_with_a_sim_preset_reports_the_ideal_per_level(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))  # no service recorded here
    monkeypatch.setattr("cluster.api.client.TandemClient", FakeService)
    monkeypatch.setattr("cluster.api.client.AsyncTandemClient", as_async(FakeService))
    out = tmp_path / "result.json"
    argv = ["loadtest", "--concurrency", "1", "2", "--duration", "0.05", "--max-tokens", "8",
            "--compare", "--preset", "sim-h100-8b", "--json", str(out),
            "--plot", str(tmp_path / "plot.png")]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["config"]["preset"] == "sim-h100-8b"
    tokenizer = load_tokenizer(resolve_pair("sim-h100-8b").target).tokenizer
    lengths = [len(tokenizer.encode(p.text, add_special_tokens=False)) for p in load_prompts(None)]
    expected = SimIdeal.from_sources("sim-h100-8b", H100_8B.target, H100_8B.draft,
                                     DEFAULT_DRAFT_TOKENS, lengths, 8)  # fmt: skip
    assert result["sim"] == expected.describe()
    assert result["sim"]["context_tokens"] == pytest.approx(sum(lengths) / len(lengths) + 4)
    for level in result["levels"]:
        assert level["ideal"] == pytest.approx(expected.level(level["concurrency"]))
        for mode in ("speculative", "target_only"):
            assert level["achieved_over_ideal"][mode] == pytest.approx(
                level[mode]["tokens_per_s"] / level["ideal"][f"{mode}_tokens_per_s"]
            )
    # Every run carries its CPU per generated token by process role; with no service recorded
    # in TANDEM_HOME, every Ray or Tandem process of this user counts.
    assert "every process of uid" in result["cpu_scope"]
    for level in result["levels"]:
        for mode in ("speculative", "target_only"):
            run = level[mode]
            assert set(run["cpu_ms_per_token"]) == set(CPU_KEYS)
            assert set(run["cpu"]["cpu_s"]) == set(CPU_KEYS)
            assert run["cpu_ms_per_token"]["load_client"] == pytest.approx(
                1000 * run["cpu"]["cpu_s"]["load_client"] / run["tokens"]
            )
            # This process is the load client, never one of the service's roles.
            service = [p for p in run["cpu"]["processes"] if p["role"] != "load_client"]
            assert os.getpid() not in {p["pid"] for p in service}
    captured = capsys.readouterr()
    assert "| ideal tokens/s | achieved/ideal |" in captured.out
    assert "| concurrency | mode | router | proxy |" in captured.out
    assert "CPU ms per generated token, by process role (every process of uid" in captured.out
    assert "concurrency 2 target_only: " in captured.err and "load client " in captured.err
    speculative = result["levels"][1]["ideal"]["speculative_tokens_per_s"]
    assert "concurrency 2 achieved/ideal: speculative " in captured.err
    assert f"(ideal {speculative:.2f} tokens/s)" in captured.err
    assert (tmp_path / "plot.png").stat().st_size > 0
    # An explicit block length is the ideal's k; a non-sim preset adds no ideal.
    assert main([*argv[:-2], "--draft-tokens", "2"]) == 0
    assert json.loads(out.read_text())["sim"]["draft_tokens"] == 2
    capsys.readouterr()
    assert main(["loadtest", "--concurrency", "1", "--duration", "0.05", "--max-tokens", "4",
                 "--preset", "tiny", "--json", str(out)]) == 0  # fmt: skip
    plain = json.loads(out.read_text())
    assert "sim" not in plain and "ideal" not in plain["levels"][0]
    assert plain["config"]["preset"] == "tiny"
    assert "ideal" not in capsys.readouterr().out


def test_the_ideal_is_refused_for_a_service_that_reports_another_preset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("cluster.tools.baselines.hf_levels.reported_model", lambda address: "tiny")
    monkeypatch.setattr("cluster.api.client.TandemClient", FakeService)
    monkeypatch.setattr("cluster.api.client.AsyncTandemClient", as_async(FakeService))
    argv = ["loadtest", "--duration", "0.05", "--preset", "sim-instant"]
    assert main(argv) == 2
    assert "the service serves 'tiny', not the preset 'sim-instant'" in capsys.readouterr().err
    monkeypatch.setattr(
        "cluster.tools.baselines.hf_levels.reported_model", lambda address: "sim-instant"
    )
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    assert main([*argv, "--concurrency", "1", "--max-tokens", "4"]) == 0
    captured = capsys.readouterr()  # sim-instant's ideal is unbounded
    assert "| – | – |" in captured.out
    assert "speculative – (ideal unbounded: the device costs nothing)" in captured.err


def test_run_modes_ask_each_mode_its_way() -> None:
    assert run_modes(4, compare=False, predraft=False) == {"speculative": {"draft_tokens": 4}}
    modes = run_modes(None, compare=True, predraft=True)
    assert list(modes) == ["speculative", "serial", "predrafted", "target_only"]
    assert modes["speculative"] == {"draft_tokens": None, "predraft_fan_out": 0}
    assert modes["serial"]["pipelined"] is False and modes["serial"]["predraft_fan_out"] == 0
    assert modes["predrafted"]["predraft_fan_out"] == MAX_PREDRAFT_FAN_OUT
    assert modes["target_only"] == {"draft_tokens": 0}


class _RecordingService(FakeService):
    asked: ClassVar[list[dict[str, Any]]] = []

    def stream(self, prompt: str, max_tokens: int, **settings: Any) -> Iterator[StreamChunk]:
        _RecordingService.asked.append(settings)
        return super().stream(prompt, max_tokens, **settings)


def test_loadtest_with_predraft_runs_serial_and_predrafted_beside_their_ideals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("cluster.api.client.TandemClient", _RecordingService)
    monkeypatch.setattr("cluster.api.client.AsyncTandemClient", as_async(_RecordingService))
    out = tmp_path / "result.json"
    argv = ["loadtest", "--concurrency", "1", "4", "--duration", "0.05", "--max-tokens", "8",
            "--compare", "--predraft", "--preset", "sim-h100-8b", "--json", str(out),
            "--plot", str(tmp_path / "plot.png")]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["config"]["predraft"] is True
    for level in result["levels"]:
        for mode in ("speculative", "serial", "predrafted", "target_only"):
            assert level[mode]["requests"] > 0
            assert level["achieved_over_ideal"][mode] == pytest.approx(
                level[mode]["tokens_per_s"] / level["ideal"][f"{mode}_tokens_per_s"]
            )
        assert level["ideal"]["predrafted_tokens_per_s"] >= level["ideal"]["serial_tokens_per_s"]
    fan_outs = {settings.get("predraft_fan_out") for settings in _RecordingService.asked}
    assert fan_outs == {0, MAX_PREDRAFT_FAN_OUT, None}  # None: the target alone asks nothing of it
    table = capsys.readouterr().out
    assert "| 4 | predrafted |" in table and "| 1 | serial |" in table
    assert (tmp_path / "plot.png").stat().st_size > 0
