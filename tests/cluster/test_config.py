"""TandemConfig: parsed once, nested, strictly typed, every problem reported with its key's path;
`tandem config schema` and `tandem config check`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from cluster.cli import config as cli_config
from cluster.cli import service as cli_service
from cluster.cli.main import main
from cluster.cli.serve_flags import config_from_flags
from cluster.config import ReplicaGroupConfig, TandemConfig
from cluster.config_parsing import ConfigError, json_schema
from cluster.runtime.errors import InvalidArgumentError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"


def test_example_config_in_deploy_parses() -> None:
    config = TandemConfig.from_yaml(DEPLOY / "tandem.yaml")
    assert config.drafter.num_replicas == 2 and config.verifier.num_replicas == 2
    assert config.models.pair().target.source == "tiny://target"


def test_the_service_adapts_and_looks_up_by_default_and_the_cli_can_turn_either_off() -> None:
    assert TandemConfig().prompt_lookup.enabled and TandemConfig().draft_length.enabled
    example = TandemConfig.from_yaml(DEPLOY / "tandem.yaml")
    assert example.prompt_lookup.enabled and example.draft_length.enabled
    parser = argparse.ArgumentParser()
    cli_service.add_to(parser.add_subparsers())
    fixed = config_from_flags(parser.parse_args(["serve", "--no-adaptive-draft"]))
    assert fixed.prompt_lookup.enabled and not fixed.draft_length.enabled
    bare = config_from_flags(parser.parse_args(["serve", "--no-prompt-lookup"]))
    assert not bare.prompt_lookup.enabled and bare.draft_length.enabled


@pytest.mark.parametrize("name", ["one-core-each", "shared-cores", "whole-machine"])
def test_placement_configs_parse(name: str) -> None:
    config = TandemConfig.from_yaml(DEPLOY / "placement" / f"{name}.yaml")
    assert config.drafter.torch_threads >= 1 and config.verifier.torch_threads >= 1


def test_nested_values_and_actor_options() -> None:
    config = TandemConfig.from_dict(
        {
            "proxy_grpc_port": 9100,
            "api": {"default_draft_tokens": 6},
            "verifier": {"num_gpus": 1, "accelerator_type": "H100", "resources": {"big": 1}},
            "drafter_limits": {"top_k": 16},
            "prompt_lookup": {"enabled": True, "max_ngram": 5},
            "verifier_limits": {"gather_share": 0},
            "draft_length": {"enabled": True, "speculation_gate": False},
        }
    )
    assert config.verifier_limits.gather_share == 0 and config.drafter_limits.gather_share > 0
    assert config.draft_length.enabled and not config.draft_length.speculation_gate
    assert config.api.default_draft_tokens == 6
    assert config.prompt_lookup.enabled and config.prompt_lookup.max_ngram == 5
    assert config.drafter_limits.top_k == 16
    assert config.verifier.ray_actor_options() == {
        "num_cpus": 0.0, "num_gpus": 1, "accelerator_type": "H100", "resources": {"big": 1},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"grpc_prot": 1}, r"^grpc_prot: unknown key \(known: api, app_name, "),
        ({"verifier": {"max_sesions": 2}}, r"^verifier\.max_sesions: unknown key"),
        ({"verifier_limits": {"max_sesions": 2}}, r"^verifier_limits\.max_sesions: unknown key"),
        ({"verifier": {"num_replicas": 0}}, r"^verifier: num_replicas must be >= 1, got 0"),
        ({"verifier": {"num_replicas": "2"}}, r"^verifier\.num_replicas must be an integer"),
        ({"verifier": {"num_replicas": True}}, r"^verifier\.num_replicas must be an integer"),
        ({"verifier": {"num_gpus": "one"}}, r"^verifier\.num_gpus must be a number, got 'one'"),
        ({"drafter_limits": {"top_k": 1.5}}, r"^drafter_limits\.top_k must be an integer"),
        ({"verifier_limits": {"gather_share": 2}}, r"^verifier_limits: gather_share must be in"),
        ({"prompt_lookup": {"enabled": "no"}}, r"^prompt_lookup\.enabled must be true or false"),
        ({"models": {"preset": "huge"}}, r"^models: unknown preset 'huge'"),
        ({"proxy_grpc_port": 70000}, r"^proxy_grpc_port must be in 1\.\.65535"),
        ({"front": {"http_port": 0}}, r"^front: front\.http_port must be in 1\.\.65535"),
        ({"api": 3}, r"^api must be a mapping, got 3"),
        ({"prompt_lookup": {"min_ngram": 0}}, r"^prompt_lookup: .*min_ngram"),
        ({"drafter": {"cpus": [0, -1]}}, r"^drafter: cpus must be CPU ids"),
        ({"drafter": {"cpus": 0}}, r"^drafter\.cpus must be a list"),
        ({"auth": {"tenants": [{"name": "a"}]}}, r"^auth\.tenants\[0\]\.key_sha256: required"),
        ([1, 2], r"^config must be a mapping"),
    ],
)
def test_bad_configs_name_the_path(data: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        TandemConfig.from_dict(data)


def test_every_problem_is_reported_at_once_and_survives_pickling() -> None:
    with pytest.raises(ConfigError) as caught:
        TandemConfig.from_dict({"proxy_grpc_port": "x", "router": {"replicas": 2}, "api": []})
    problems = caught.value.problems
    assert sorted(problem.split()[0] for problem in problems) == [
        "api", "proxy_grpc_port", "router.replicas:",
    ]  # fmt: skip
    copy = pickle.loads(pickle.dumps(caught.value))  # how Ray Serve hands an error back
    assert copy.problems == problems and str(copy) == str(caught.value)


def test_a_secret_of_the_wrong_type_is_not_echoed() -> None:
    with pytest.raises(ConfigError, match="cluster_secret must be a string") as caught:
        TandemConfig.from_dict({"cluster_secret": 1234567890123456789})
    assert "1234567890123456789" not in str(caught.value)


def test_configs_built_in_python_are_still_checked_and_replaceable_and_picklable() -> None:
    with pytest.raises(InvalidArgumentError, match="num_replicas must be >= 1"):
        ReplicaGroupConfig(num_replicas=0)
    config = TandemConfig.from_yaml(DEPLOY / "tandem.yaml")
    wider = dataclasses.replace(config, verifier=dataclasses.replace(config.verifier, num_gpus=1))
    assert wider.verifier.num_gpus == 1 and wider.drafter == config.drafter
    assert pickle.loads(pickle.dumps(wider)) == wider  # Ray Serve pickles it to the replicas


def test_unreadable_yaml(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("verifier: [unclosed")
    with pytest.raises(InvalidArgumentError, match="not valid YAML"):
        TandemConfig.from_yaml(bad)
    with pytest.raises(InvalidArgumentError, match="cannot read config"):
        TandemConfig.from_yaml(tmp_path / "absent.yaml")


# --- tandem config schema / check ------------------------------------------------------------


def _schema_from_cli(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["config", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert isinstance(schema, dict)
    return schema


def test_the_schema_is_json_with_every_top_level_key(capsys: pytest.CaptureFixture[str]) -> None:
    schema = _schema_from_cli(capsys)
    assert schema == json_schema(TandemConfig)
    properties = schema["properties"]
    assert isinstance(properties, dict)
    assert set(properties) == {f.name for f in dataclasses.fields(TandemConfig)}
    assert schema["additionalProperties"] is False
    assert properties["proxy_grpc_port"]["description"].startswith("Port of Serve's gRPC proxy")
    assert properties["front"]["default"] == {
        "grpc_port": 9000,
        "http_port": 8000,
        "host": "0.0.0.0",
        "max_request_bytes": 4 << 20,
        "max_body_bytes": 4 << 20,
        "body_timeout_s": 30.0,
        "header_timeout_s": 10.0,
        "max_health_watches": 64,
        "max_health_watches_per_caller": 8,
    }
    # A field declared by a base class keeps its docstring (pydantic alone would drop it).
    limits = schema["$defs"]["VerifierConfig"]["properties"]
    assert limits["max_sessions"]["description"].startswith("Sessions held at once")
    # A default made by a factory is shown as the config's, not the bare class's.
    assert properties["prompt_lookup"]["default"]["enabled"] is True


def test_the_schema_validates_the_examples_and_rejects_typos(
    capsys: pytest.CaptureFixture[str],
) -> None:
    validator = jsonschema.Draft202012Validator(_schema_from_cli(capsys))
    for name in ("tandem.yaml", "placement/one-core-each.yaml"):
        validator.validate(yaml.safe_load((DEPLOY / name).read_text()))
    errors = list(validator.iter_errors({"verifier": {"max_sesions": 2}, "proxy_grpc_port": "x"}))
    assert sorted(list(error.absolute_path) for error in errors) == [
        ["proxy_grpc_port"], ["verifier"],
    ]  # fmt: skip


@pytest.mark.parametrize(
    "name",
    [
        "tandem.yaml",
        "serve-local.yaml",
        "kuberay/rayservice.yaml",
        "placement/shared-cores.yaml",
        "placement/nodes.yaml",
    ],
)
def test_check_passes_the_deploy_files(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "check", str(DEPLOY / name)]) == 0
    assert capsys.readouterr().out == "ok\n"


def test_check_prints_each_problem_with_its_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("verifier:\n  max_sesions: 3\n  num_replicas: two\n")
    assert main(["config", "check", str(bad)]) == 2
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(line.startswith(f"{bad}: verifier.") for line in lines)
    assert any("verifier.max_sesions: unknown key" in line for line in lines)
    assert any("verifier.num_replicas must be an integer, got 'two'" in line for line in lines)


def test_check_reads_the_tandem_apps_of_a_serve_config(tmp_path: Path) -> None:
    serve = yaml.safe_load((DEPLOY / "serve-local.yaml").read_text())
    serve["applications"][0]["args"]["drafter"]["gpus"] = 1
    serve["applications"].append(
        {"name": "other", "import_path": "elsewhere:app", "args": {"x": 1}}
    )
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(serve))
    assert cli_config.check_file(str(path)) == [
        f"{path}: applications[0].args: drafter.gpus: unknown key (known: accelerator_type, "
        "autoscaling, cpus, num_cpus, num_gpus, num_replicas, quantization, resources, "
        "torch_threads, trimmed_vocab)"
    ]
    path.write_text(yaml.safe_dump({"applications": [{"import_path": "elsewhere:app"}]}))
    assert cli_config.check_file(str(path)) == [
        f"{path}: no application has import_path cluster.serve.app:app_builder"
    ]


def test_check_names_the_real_app_builder() -> None:
    from cluster.serve.app import app_builder

    assert f"{app_builder.__module__}:{app_builder.__name__}" == cli_config.APP_BUILDER


def test_check_of_a_missing_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "check", str(tmp_path / "absent.yaml")]) == 2
    assert "INVALID_ARGUMENT: cannot read config" in capsys.readouterr().err


def test_the_draft_is_quantized_as_the_preset_the_config_or_the_cli_says() -> None:
    assert TandemConfig().pair().draft.quantization == "none"  # tiny: as loaded
    qwen = TandemConfig.from_dict({"models": {"preset": "qwen-coder"}})
    assert qwen.pair().draft.quantization == "int8"  # the preset's choice
    assert qwen.pair().target.quantization == "none"
    chosen = TandemConfig.from_dict({"models": {"preset": "qwen-coder"},
                                     "drafter": {"quantization": "none"}})  # fmt: skip
    assert chosen.pair().draft.quantization == "none"
    parser = argparse.ArgumentParser()
    cli_service.add_to(parser.add_subparsers())
    args = parser.parse_args(["serve", "--draft-quantization", "int8-dynamic", "--drafters", "2"])
    config = config_from_flags(args)
    assert config.drafter.num_replicas == 2
    assert config.pair().draft.quantization == "int8-dynamic"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"drafter": {"quantization": "int2"}}, "quantization must be one of"),
        ({"verifier": {"quantization": "int8"}}, "only the drafter's model may be changed"),
        ({"router": {"quantization": "none"}}, "only the drafter's model may be changed"),
    ],
)
def test_bad_quantizations_are_refused(data: dict[str, Any], message: str) -> None:
    with pytest.raises((ConfigError, InvalidArgumentError), match=message):
        TandemConfig.from_dict(data)
