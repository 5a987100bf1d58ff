"""TandemConfig: parsed once, nested, unknown keys rejected with their path."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from cluster.cli import service as cli_service
from cluster.config import TandemConfig
from verifier.runtime.errors import InvalidArgumentError

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_example_config_in_deploy_parses() -> None:
    config = TandemConfig.from_yaml(REPO_ROOT / "deploy" / "tandem.yaml")
    assert config.drafter.num_replicas == 2 and config.verifier.num_replicas == 2
    assert config.models.pair().target.source == "tiny://target"


def test_the_service_adapts_and_looks_up_by_default_and_the_cli_can_turn_either_off() -> None:
    assert TandemConfig().prompt_lookup.enabled and TandemConfig().draft_length.enabled
    example = TandemConfig.from_yaml(REPO_ROOT / "deploy" / "tandem.yaml")
    assert example.prompt_lookup.enabled and example.draft_length.enabled
    parser = argparse.ArgumentParser()
    cli_service.add_to(parser.add_subparsers())
    fixed = cli_service._config(parser.parse_args(["serve", "--no-adaptive-draft"]))
    assert fixed.prompt_lookup.enabled and not fixed.draft_length.enabled
    bare = cli_service._config(parser.parse_args(["serve", "--no-prompt-lookup"]))
    assert not bare.prompt_lookup.enabled and bare.draft_length.enabled


@pytest.mark.parametrize("name", ["one-core-each", "shared-cores", "whole-machine"])
def test_placement_configs_parse(name: str) -> None:
    config = TandemConfig.from_yaml(REPO_ROOT / "deploy" / "placement" / f"{name}.yaml")
    assert config.drafter.torch_threads >= 1 and config.verifier.torch_threads >= 1


def test_nested_values_and_actor_options() -> None:
    config = TandemConfig.from_dict(
        {
            "grpc_port": 9100,
            "api": {"default_draft_tokens": 6},
            "verifier": {"num_gpus": 1, "accelerator_type": "H100", "resources": {"big": 1}},
            "drafter_limits": {"top_k": 16},
            "prompt_lookup": {"enabled": True, "max_ngram": 5},
        }
    )
    assert config.api.default_draft_tokens == 6
    assert config.prompt_lookup.enabled and config.prompt_lookup.max_ngram == 5
    assert config.drafter_limits.top_k == 16
    assert config.verifier.ray_actor_options() == {
        "num_cpus": 0.0, "num_gpus": 1, "accelerator_type": "H100", "resources": {"big": 1},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"grpc_prot": 1}, "unknown config key: grpc_prot"),
        ({"verifier": {"replicas": 2}}, "unknown config key in verifier: replicas"),
        ({"verifier": {"num_replicas": 0}}, "num_replicas must be >= 1"),
        ({"models": {"preset": "huge"}}, "unknown preset 'huge'"),
        ({"grpc_port": 70000}, "grpc_port"),
        ({"api": 3}, "api must be a mapping"),
        ({"prompt_lookup": {"min_ngram": 0}}, "min_ngram"),
        ({"drafter": {"cpus": [0, -1]}}, "cpus must be CPU ids"),
    ],
)
def test_bad_configs(data: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        TandemConfig.from_dict(data)


def test_unreadable_yaml(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("verifier: [unclosed")
    with pytest.raises(InvalidArgumentError, match="not valid YAML"):
        TandemConfig.from_yaml(bad)
    with pytest.raises(InvalidArgumentError, match="cannot read config"):
        TandemConfig.from_yaml(tmp_path / "absent.yaml")
