"""The Hugging Face baseline of `tandem loadtest --hf-baseline`: its measuring core on the tiny
target (figures, token counts, the target's own greedy output, threads stopped on Ctrl-C, the
model freed), how it finds the service's target, and the load test's JSON with it."""

from __future__ import annotations

import gc
import http.server
import json
import os
import signal
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from cluster.api.client_types import StreamChunk
from cluster.cli.main import main
from cluster.runtime import tiny
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.model_spec import TINY_TARGET, ModelSpec
from cluster.tools import cleanup
from cluster.tools.baselines import hf_baseline
from cluster.tools.baselines.hf_baseline import METHODS, LevelRun, TargetBaseline, choose_method
from cluster.tools.baselines.hf_levels import reported_model, service_target
from tests.cluster.tools.load_fakes import as_async

MAX_TOKENS = 12
# Different lengths, so that a padded batch really pads.
TEXTS = ("def add(a, b):\n", "Hello, world! How are", "import os\n\n\nclass Stack:\n    pass\n")


@pytest.fixture(scope="module")
def baseline() -> Iterator[TargetBaseline]:
    with TargetBaseline.load(ModelSpec(TINY_TARGET), threads=1) as loaded:
        yield loaded


def _plain_generate(baseline: TargetBaseline, prompt: tuple[int, ...]) -> tuple[int, ...]:
    """The target alone on one prompt, no batch: what the baseline must reproduce."""
    model: Any = baseline.loaded.model
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
    tokens = out[0, len(prompt) :].tolist()
    end = tokens.index(tiny.END_OF_TEXT_ID) + 1 if tiny.END_OF_TEXT_ID in tokens else len(tokens)
    return tuple(tokens[:end])


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("concurrency", [1, 3])
def test_a_run_counts_tokens_and_latencies(
    baseline: TargetBaseline, method: str, concurrency: int
) -> None:
    prompts = baseline.encode(TEXTS)
    run = baseline.run(method, prompts, concurrency, duration_s=0.3, max_tokens=MAX_TOKENS)
    summary = run.summary()
    assert summary["method"] == method and summary["concurrency"] == concurrency
    # Every stream started before the deadline finished whole.
    assert summary["requests"] == len(run.lengths) >= concurrency
    assert summary["tokens"] == sum(run.lengths)
    assert summary["tokens_per_s"] == summary["tokens"] / summary["seconds"] > 0
    # Each request yields max_tokens tokens, or fewer ending at the end-of-sequence id.
    for output in run.outputs.values():
        assert len(output) == MAX_TOKENS or (
            output[-1] == tiny.END_OF_TEXT_ID and len(output) < MAX_TOKENS
        )
        assert tiny.END_OF_TEXT_ID not in output[:-1]
    assert set(run.lengths) <= {len(output) for output in run.outputs.values()}
    for figure in ("itl_ms", "ttft_ms"):
        p50, p99 = summary[figure]["p50"], summary[figure]["p99"]
        assert p50 is not None and p99 is not None and 0 < p50 <= p99
    # One gap between each two consecutive tokens of every request.
    assert len(run.inter_token_s) == sum(n - 1 for n in run.lengths)


@pytest.mark.parametrize("method", METHODS)
def test_both_methods_give_the_targets_own_greedy_output(
    baseline: TargetBaseline, method: str
) -> None:
    prompts = baseline.encode(TEXTS)
    run = baseline.run(method, prompts, len(prompts), duration_s=0.01, max_tokens=MAX_TOKENS)
    assert set(run.outputs) == set(prompts)
    for prompt in prompts:
        assert run.outputs[prompt] == _plain_generate(baseline, prompt)


def _ctrl_c(*args: Any) -> None:
    raise KeyboardInterrupt


def _sigterm(*args: Any) -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5.0)  # the handler raises in this (the main) thread well before


@pytest.mark.parametrize(
    ("interrupt", "raised"), [(_ctrl_c, KeyboardInterrupt), (_sigterm, cleanup.Terminated)]
)
def test_the_model_is_restored_and_its_threads_stop_when_interrupted(
    baseline: TargetBaseline,
    monkeypatch: pytest.MonkeyPatch,
    interrupt: Any,
    raised: type[BaseException],
) -> None:
    prompts = baseline.encode(TEXTS)
    before = set(threading.enumerate())
    attention = baseline.loaded.model.config._attn_implementation
    monkeypatch.setattr(LevelRun, "add", interrupt)  # the first request to finish interrupts
    # As `tandem loadtest` runs a level: SIGTERM unwinds like Ctrl-C.
    with pytest.raises(raised), cleanup.signals_raise():
        baseline.run("generate_batch", prompts, 3, duration_s=5.0, max_tokens=MAX_TOKENS)
    # The continuous batching thread was joined, and the model got its attention back.
    assert set(threading.enumerate()) <= before
    assert baseline.loaded.model.config._attn_implementation == attention


def test_close_frees_the_model() -> None:
    loaded = TargetBaseline.load(ModelSpec(TINY_TARGET), threads=1)
    for method in METHODS:  # nothing a run made keeps the model alive
        loaded.run(method, loaded.encode(TEXTS), 2, duration_s=0.0, max_tokens=4)
    model = weakref.ref(loaded.loaded.model)
    loaded.close()
    gc.collect()
    assert model() is None
    with pytest.raises(RuntimeError, match="freed"):
        loaded.run("generate", [(1, 2)], 1, 0.1, 2)


def test_choose_method_keeps_the_faster(
    baseline: TargetBaseline, monkeypatch: pytest.MonkeyPatch
) -> None:
    rates = {"generate": 10.0, "generate_batch": 25.0}

    def fake_run(method: str, *args: Any) -> LevelRun:
        return LevelRun(method, 4, seconds=1.0, lengths=[int(rates[method])])

    monkeypatch.setattr(baseline, "run", fake_run)
    choice = choose_method(baseline, [(1,)], 4, probe_s=2.0, max_tokens=8)
    assert choice["method"] == "generate_batch"
    assert choice["probe_tokens_per_s"] == rates
    assert "25.00 tokens/s against 10.00 for generate" in choice["why"]


def test_the_batching_cache_holds_the_streams_in_flight() -> None:
    config = hf_baseline._batching_config(concurrency=4, longest_prompt=70, max_tokens=30)
    pages = 100 // hf_baseline.PAGE_TOKENS + 1 + 1  # 100 tokens span 4 pages, plus a spare
    assert config.num_blocks == 4 * pages and config.max_requests_per_batch == 4
    assert config.max_batch_tokens == 74 and config.allow_block_sharing is False


def test_service_target_from_the_preset_the_config_or_the_service(tmp_path: Path) -> None:
    spec, threads = service_target("tiny", None, None)
    assert spec == ModelSpec(TINY_TARGET, dtype="float32")
    assert threads == len(os.sched_getaffinity(0))  # the whole machine, not one replica
    assert service_target(None, None, "tiny")[0].source == TINY_TARGET
    config = tmp_path / "serve.yaml"
    config.write_text("verifier:\n  num_cpus: 3\n")
    assert service_target(None, str(config), None)[1] == len(os.sched_getaffinity(0))
    config.write_text("verifier:\n  num_cpus: 3\n  torch_threads: 2\nmodels:\n  dtype: float16\n")
    spec, threads = service_target("tiny", str(config), "tiny")
    assert (spec.dtype, threads) == ("float16", len(os.sched_getaffinity(0)))
    with pytest.raises(InvalidArgumentError, match="give --preset"):
        service_target(None, None, None)
    with pytest.raises(InvalidArgumentError, match="serves 'qwen-coder', not 'tiny'"):
        service_target("tiny", None, "qwen-coder")


class _Models(http.server.BaseHTTPRequestHandler):
    """`GET /v1/models` of a service serving `tiny` to the key `secret`."""

    def do_GET(self) -> None:
        ok = self.path == "/v1/models" and self.headers["Authorization"] == "Bearer secret"
        body = json.dumps({"object": "list", "data": [{"id": "tiny"}]}).encode()
        self.send_response(200 if ok else 401)
        self.end_headers()
        self.wfile.write(body if ok else b"{}")

    def log_message(self, *args: Any) -> None:
        pass


def test_the_load_test_asks_the_service_it_started_here_for_its_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cluster.serve import ray_cluster

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    monkeypatch.setenv(ray_cluster.API_KEY_ENV, "secret")
    assert reported_model("127.0.0.1:9000") is None  # no service recorded
    server = http.server.HTTPServer(("127.0.0.1", 0), _Models)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        state = ray_cluster.ClusterState("127.0.0.1:1", str(tmp_path), True, grpc_port=9000,
                                           http_port=server.server_address[1])  # fmt: skip
        ray_cluster.save_state(state)
        assert reported_model("127.0.0.1:9000") == "tiny"
        assert reported_model("127.0.0.1:9001") is None  # another service than the recorded
        monkeypatch.setenv(ray_cluster.API_KEY_ENV, "wrong")
        assert reported_model("127.0.0.1:9000") is None
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


class ReferenceClient:
    """A fake service: the tiny target's greedy output per prompt, streamed in two chunks."""

    def __init__(self, address: str, **options: Any) -> None:
        self.baseline = TargetBaseline.load(ModelSpec(TINY_TARGET), threads=1)
        self.outputs: dict[str, tuple[int, ...]] = {}

    def __enter__(self) -> ReferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.baseline.close()

    def _output(self, prompt: str, max_tokens: int) -> tuple[int, ...]:
        if prompt not in self.outputs:
            (ids,) = self.baseline.encode([prompt])
            run = self.baseline.run("generate", [ids], 1, 0.0, max_tokens)  # one request
            self.outputs[prompt] = run.outputs[ids]
        return self.outputs[prompt]

    def generate(self, prompt: str, max_tokens: int, **settings: Any) -> SimpleNamespace:
        return SimpleNamespace(tokens=self._output(prompt, max_tokens))  # all the load test reads

    def stream(self, prompt: str, max_tokens: int, **settings: Any) -> Iterator[StreamChunk]:
        tokens = self._output(prompt, max_tokens)
        yield StreamChunk("r", tokens[:1], "")
        yield StreamChunk("r", tokens[1:], "", "length")


def test_the_load_test_reports_the_baseline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))  # no service recorded here
    monkeypatch.setattr("cluster.api.client.TandemClient", ReferenceClient)
    monkeypatch.setattr("cluster.api.client.AsyncTandemClient", as_async(ReferenceClient))
    out = tmp_path / "result.json"
    argv = ["loadtest", "--concurrency", "1", "8", "--duration", "0.2", "--max-tokens", "6",
            "--compare", "--hf-baseline", "--preset", "tiny", "--json", str(out),
            "--plot", str(tmp_path / "plot.png")]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    for level in result["levels"]:
        hf = level["hf_target_batched"]
        assert hf["tokens_per_s"] > 0 and hf["requests"] >= level["concurrency"]
        assert hf["itl_ms"]["p50"] is not None and hf["itl_ms"]["p99"] is not None
        assert hf["differs_from_service"] == 0  # the same weights, greedy
        assert {"speculative", "target_only", "speedup"} <= level.keys()
    assert result["hf_baseline"]["method"] in METHODS
    assert "probe at concurrency 8" in result["hf_baseline"]["why"]
    assert result["hf_baseline"]["target"] == TINY_TARGET
    goals = result["goals"]
    assert goals["speculative_8_over_1"] == pytest.approx(
        result["levels"][1]["speculative"]["tokens_per_s"]
        / result["levels"][0]["speculative"]["tokens_per_s"]
    )
    assert [g["concurrency"] for g in goals["levels"]] == [1, 8]
    assert all(g["speculative_over_hf_target_batched"] > 0 for g in goals["levels"])
    captured = capsys.readouterr()
    assert "| 8 | hf_target_batched |" in captured.out and "speedup vs HF" in captured.out
    assert "concurrency 8 hf_target_batched" in captured.err
    assert (tmp_path / "plot.png").stat().st_size > 0
