"""guidellm, vLLM's load-testing client, against the session's service over HTTP.

guidellm (a dev dependency, pinned in pyproject.toml) speaks vLLM's dialect of the OpenAI API:
a `GET /health` before the run, then streamed requests carrying `ignore_eos: true`,
`stop: null` and `stream_options.continuous_usage_stats`. Its CLI runs here as a user would
run it (tests/cluster/conftest.py's tiny service, synthetic prompts counted in the tiny
model's byte tokenizer, saved to a folder because guidellm loads one by path and must not
reach a model hub), at a fixed concurrency for a few seconds, once per request format; its
JSON report must show requests completed with every token asked for, none errored, and
latencies measured from the stream. guidellm cancels the streams still running when its time
is up: no session may stay open on any replica afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cluster.runtime.tiny import build_tokenizer
from tests.cluster.conftest import TENANT_KEYS, wait_until_no_sessions

pytestmark = [pytest.mark.ray, pytest.mark.slow]

GUIDELLM = Path(sys.executable).with_name("guidellm")
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 16
STREAMS = 4
NUM_REQUESTS = 12
"""guidellm's own request constraint: the run ends after this many, however long they take."""
RUN_TIMEOUT_S = 240
"""guidellm's own start (torch, datasets) takes 5-10 s on 2 cores; the load a few more."""
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny pair's tokenizer as a folder: what guidellm counts synthetic tokens with."""
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tokenizer().save_pretrained(str(folder))
    return folder


def run_guidellm(
    service: dict[str, object], tokenizer_dir: Path, request_format: str, out_dir: Path
) -> dict[str, Any]:
    """One guidellm run against the service; its JSON report."""
    assert GUIDELLM.exists(), f"{GUIDELLM} is missing: `make setup` installs the dev extras"
    target = str(service["http_url"]).removesuffix("/v1")
    report = out_dir / "guidellm.json"
    # Only loopback: the environment forbids the hub, and the target is the local service.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUIDELLM__")} | OFFLINE
    run = subprocess.run(
        [str(GUIDELLM), "run",
         "--backend", f"kind=openai_http,target={target},api_key={TENANT_KEYS['main']},"
                      f"request_format={request_format}",
         "--profile", f"kind=concurrent,streams={STREAMS}",
         "--constraint", f"kind=max_requests,count={NUM_REQUESTS}",
         "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
         "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
                   f"output_tokens={OUTPUT_TOKENS}",
         "--output", f"kind=json,path={report}",
         "--disable-console-interactive"],
        cwd=out_dir, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
        check=False,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    parsed: dict[str, Any] = json.loads(report.read_text())
    return parsed


@pytest.mark.parametrize("request_format", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_runs_against_the_service_without_errors(
    service: dict[str, object], tokenizer_dir: Path, tmp_path: Path, request_format: str
) -> None:
    report = run_guidellm(service, tokenizer_dir, request_format, tmp_path)
    [benchmark] = report["benchmarks"]
    assert benchmark["config"]["backend"]["model"] == "tiny"  # found through GET /v1/models
    totals = benchmark["metrics"]["request_totals"]
    errors = [r["info"]["error"] for r in benchmark["requests"]["errored"][:3]]
    assert totals["errored"] == 0, f"{totals}; first errors: {errors}"
    # Counted by guidellm's own constraint, not by a wall-clock window: every request asked for
    # completed.
    assert totals["successful"] == NUM_REQUESTS, totals
    completed = benchmark["requests"]["successful"]
    assert len(completed) == totals["successful"]
    # `ignore_eos`: every request runs to the tokens asked for, though the random tiny
    # target often picks its end-of-text token sooner.
    assert {r["output_metrics"]["text_tokens"] for r in completed} == {OUTPUT_TOKENS}
    if request_format == "/v1/completions":
        # Same byte tokenizer on both sides, no template: the service counts what was sent.
        assert {r["input_metrics"]["text_tokens"] for r in completed} == {PROMPT_TOKENS}
    metrics = benchmark["metrics"]
    for name in ("time_to_first_token_ms", "inter_token_latency_ms", "output_tokens_per_second"):
        stats = metrics[name]["successful"]
        assert stats["count"] > 0 and stats["percentiles"]["p50"] > 0, (name, stats)
    # Streams cut off when guidellm's time was up freed their sessions on every replica.
    assert not any(wait_until_no_sessions(service).values())
