"""`tandem generate`, in-process (`--local`) and against a server (`--address`): the JSON
contract, streaming text, and clean errors."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import cluster.local
from cluster.api.service import TandemService
from cluster.api.tenants import Tenants
from cluster.cli.generate import JSON_KEYS
from cluster.cli.main import main
from cluster.local import LocalTandem, build_local
from cluster.routing.router import Router
from tests.cluster.grpc_front import serve_local

REPO_ROOT = Path(__file__).resolve().parents[3]
BASE = ["generate", "--local", "--preset", "tiny", "--max-tokens", "24"]
CODE = "def add(a, b):"


def run_json(capsys: pytest.CaptureFixture[str], *flags: str) -> dict[str, Any]:
    assert main([*BASE, *flags, "--json", CODE]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def lockstep_local(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--local` builds its router in lockstep (`verifier_advances` off): every token through a
    posted block, so that the speculation counters are the drafts' alone. With running
    sessions the in-process tiny drafter's blocks mostly come after the verifier took those
    tokens alone, and when they come is a matter of timing."""
    monkeypatch.setattr(
        cluster.local, "build_local", functools.partial(build_local, verifier_advances=False)
    )


def _serve(router: Router, local_tandem: LocalTandem) -> Iterator[str]:
    server, port = serve_local(
        TandemService(router, local_tandem.tokenizer, tenants=Tenants.unauthenticated())
    )
    yield f"127.0.0.1:{port}"
    server.stop(None)


@pytest.fixture(scope="module")
def address(local_tandem: LocalTandem) -> Iterator[str]:
    yield from _serve(local_tandem.router, local_tandem)


@pytest.fixture(scope="module")
def lockstep_address(local_tandem: LocalTandem, lockstep: Router) -> Iterator[str]:
    """A server whose router runs in lockstep, as `lockstep_local` builds `--local`'s."""
    yield from _serve(lockstep, local_tandem)


@pytest.mark.usefixtures("lockstep_local")
def test_json_contract(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(capsys, "--draft-tokens", "4")
    assert tuple(result) == JSON_KEYS
    assert isinstance(result["tokens"], list) and len(result["tokens"]) == 24
    assert result["finish_reason"] == "length"
    assert result["num_drafted"] > 0
    assert result["acceptance_rate"] == result["num_accepted"] / result["num_drafted"]
    # Each verify pass adds one token of the target's own, except where a wholly accepted
    # block deferred its bonus token to the block drafted after it. That block counts as a
    # pipeline hit only when it was posted ahead of the verdict (on assumed tokens); drafted
    # too late, it is posted after it as a plain block, so hits are at most the deferred
    # bonuses (the exact count of a serial request: test_no_pipelined_counts_no_pipeline_hits).
    emitted_at_most = result["num_accepted"] + result["num_verify_passes"] - result["pipeline_hits"]
    assert emitted_at_most >= 24
    assert isinstance(result["request_id"], str) and len(result["request_id"]) == 32


@pytest.mark.usefixtures("lockstep_local")
def test_no_pipelined_counts_no_pipeline_hits(capsys: pytest.CaptureFixture[str]) -> None:
    pipelined = run_json(capsys, "--pipelined")
    serial = run_json(capsys, "--no-pipelined")
    assert pipelined["tokens"] == serial["tokens"]  # greedy: lossless either way
    # Whether a block drafted ahead comes before its predecessor's verdict (a hit or a miss)
    # or after it (a plain block) is timing now, so a pipelined request may count neither.
    # That it pipelined shows in its deferred bonus tokens: a wholly accepted block asked to
    # defer its bonus ends without a token of the target's own (greedy: the same each run).
    assert pipelined["num_accepted"] + pipelined["num_verify_passes"] > 24
    assert serial["pipeline_hits"] == serial["pipeline_misses"] == 0
    assert serial["num_accepted"] + serial["num_verify_passes"] == 24


def test_draft_tokens_zero_is_the_same_greedy_output(capsys: pytest.CaptureFixture[str]) -> None:
    speculative = run_json(capsys, "--draft-tokens", "6")
    target_only = run_json(capsys, "--draft-tokens", "0")
    assert speculative["tokens"] == target_only["tokens"]
    assert target_only["num_drafted"] == 0
    assert target_only["num_verify_passes"] == 24


def test_seeded_sampling_repeats(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ("--temperature", "0.8", "--top-p", "0.9", "--seed", "42")
    assert run_json(capsys, *flags)["tokens"] == run_json(capsys, *flags)["tokens"]


def test_streams_text_without_json(capsys: pytest.CaptureFixture[str]) -> None:
    streamed_code = main([*BASE, "def add(a, b):"])
    streamed = capsys.readouterr().out
    assert streamed_code == 0
    assert streamed == run_json(capsys)["text"] + "\n"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-tokens", "-1"], "max_tokens must be >= 1, got -1"),
        (["--temperature", "nan"], "temperature must be a finite number"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "0"], "top_p"),
        (["--draft-tokens", "99"], "draft_tokens must be in 0..32"),
        (["--seed", "-4"], "seed"),
        (["--device", "tpu"], "device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
        (["--dtype", "int3"], "dtype must be one of float32, bfloat16, float16"),
        (
            ["--preset", "nope"],
            "unknown preset 'nope'; known presets: qwen-coder, qwen-coder-self-int4, "
            "qwen-coder-self-int8, sim-h100-8b, sim-h100-8b-a06, sim-h200-70b, sim-instant, tiny",
        ),
    ],
)
def test_bad_flags_get_a_clear_error(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main([*BASE, *flags, "hello"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("tandem: error: INVALID_ARGUMENT: ")
    assert "Traceback" not in err


def test_empty_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*BASE, ""]) == 2
    assert "prompt text must not be empty" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ([], "one of the arguments --local --address is required"),
        (["--local", "--address", "h:1"], "argument --address: not allowed with argument --local"),
    ],
)
def test_exactly_one_of_local_and_address(
    capsys: pytest.CaptureFixture[str], where: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *where, "hello"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.usefixtures("lockstep_local")
def test_address_json_equals_local(
    lockstep_address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Both in lockstep and serial, so that the speculation counters too are the same each run
    # (with running sessions, or a block drafted ahead, they depend on when drafts come).
    local = run_json(capsys, "--no-pipelined")
    remote_flags = ["--address", lockstep_address, "--max-tokens", "24", "--no-pipelined"]
    assert main(["generate", *remote_flags, "--json", CODE]) == 0
    remote = json.loads(capsys.readouterr().out)
    assert tuple(remote) == JSON_KEYS
    assert remote["request_id"] != local["request_id"]
    del remote["request_id"], local["request_id"]
    assert remote == local


def test_address_streams_text(address: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--address", address, "--max-tokens", "24", CODE]) == 0
    streamed = capsys.readouterr().out
    assert streamed == run_json(capsys)["text"] + "\n"


def test_address_bad_input_and_server_side_flags(
    address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", "--address", address, "--max-tokens", "0", CODE]) == 2
    captured = capsys.readouterr()
    assert captured.err == "tandem: error: INVALID_ARGUMENT: max_tokens must be >= 1, got 0\n"
    assert captured.out == ""
    server_side = ["--preset", "tiny", "--device", "cpu"]
    assert main(["generate", "--address", address, *server_side, CODE]) == 2
    assert "--preset, --device cannot be used with --address" in capsys.readouterr().err


def test_unreachable_server_is_a_failure(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--address", "127.0.0.1:1", "--max-tokens", "4", CODE]) == 1
    assert capsys.readouterr().err.startswith("tandem: error: UNAVAILABLE: ")


def test_address_mode_needs_no_torch() -> None:
    """A remote `tandem generate` must start fast: importing the CLI loads no torch."""
    check = "import sys, cluster.cli.main; sys.exit('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-c", check], env=env, timeout=120, check=False)
    assert done.returncode == 0


@pytest.mark.slow
def test_console_script_end_to_end() -> None:
    """The installed `tandem` entry point, as a user runs it, for a result and an error."""
    tandem = Path(sys.executable).with_name("tandem")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    ok = subprocess.run(
        [str(tandem), *BASE, "--json", "def add(a, b):"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert len(json.loads(ok.stdout)["tokens"]) == 24
    bad = subprocess.run(
        [str(tandem), *BASE, "--temperature", "nan", "hi"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert bad.returncode == 2
    assert "temperature" in bad.stderr and "Traceback" not in bad.stderr
