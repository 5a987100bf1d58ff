"""`tandem config schema` and `tandem config check FILE`: the config file's JSON schema, and
whether a file validates.

`schema` prints the JSON schema of a TandemConfig file (what `tandem serve --config` reads),
field docs included, for editors to validate and complete YAML against. `check` validates a
TandemConfig file, or a Ray Serve config file whose applications are built by Tandem's
`app_builder` (each one's `args` is a TandemConfig; KubeRay's RayService holds one in
`spec.serveConfigV2`, alone in its file or beside other objects, as in
deploy/kuberay/rayservice.yaml), and prints "ok" or every problem found,
one a line, led by its file and key path; it then exits with status 2, like any wrong input.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from cluster.runtime.errors import InvalidArgumentError

APP_BUILDER = "cluster.serve.app:app_builder"
"""The import path of Tandem's Serve application builder, as a Serve config names it."""
EXIT_INVALID = 2
"""The exit status of a file that does not validate (the `tandem` command's for wrong input)."""


def add_to(commands: Any) -> None:
    config = commands.add_parser("config", help="the config file's schema, and checking a file")
    actions = config.add_subparsers(dest="action", required=True, metavar="ACTION")
    schema = actions.add_parser("schema", help="print the JSON schema of a config file")
    schema.set_defaults(handler=schema_command)
    check = actions.add_parser("check", help="validate a config file: 'ok' or its problems")
    check.add_argument(
        "file", help="a TandemConfig YAML, or a Serve config whose applications use Tandem's"
    )
    check.set_defaults(handler=check_command)


def schema_command(args: argparse.Namespace) -> int:
    # Imported here: the config classes pull in torch, which other subcommands must not wait for.
    from cluster.config import TandemConfig
    from cluster.config_parsing import json_schema

    print(json.dumps(json_schema(TandemConfig), indent=2))
    return 0


def check_command(args: argparse.Namespace) -> int:
    problems = check_file(args.file)
    for problem in problems:
        print(problem)
    if problems:
        return EXIT_INVALID
    print("ok")
    return 0


def check_file(path: str) -> list[str]:
    """Every problem of the config file at `path`, each led by where it is; none: it is valid.
    An unreadable file or invalid YAML raises InvalidArgumentError."""
    from cluster.config import TandemConfig
    from cluster.config_parsing import ConfigError

    data = _content(path)
    if isinstance(data, dict) and data.get("kind") == "RayService":  # KubeRay's: Serve's inside
        import yaml

        try:
            data = yaml.safe_load((data.get("spec") or {}).get("serveConfigV2") or "") or {}
        except yaml.YAMLError as error:
            return [f"{path}: spec.serveConfigV2 is not valid YAML: {error}"]
    configs = {path: data}
    if isinstance(data, dict) and "applications" in data:  # a Serve config (no TandemConfig key)
        configs = {
            f"{path}: applications[{i}].args": app.get("args") or {}
            for i, app in enumerate(data["applications"] or [])
            if isinstance(app, dict) and app.get("import_path") == APP_BUILDER
        }
        if not configs:
            return [f"{path}: no application has import_path {APP_BUILDER}"]
    problems = []
    for where, config in configs.items():
        try:
            TandemConfig.from_dict(config)
        except ConfigError as error:
            problems += [f"{where}: {problem}" for problem in error.problems]
    return problems


def _content(path: str) -> Any:
    """The file's YAML content: its one document, or of a manifest of several objects (a
    RayService and its Services, for one `kubectl apply -f`) the RayService."""
    from cluster.config_parsing import load_yaml

    try:
        return load_yaml(path)
    except InvalidArgumentError:
        ray_service = _the_ray_service(path)
        if ray_service is None:
            raise
        return ray_service


def _the_ray_service(path: str) -> dict[str, Any] | None:
    """The one RayService among the documents of `path`; None if there is not exactly one
    (or the file cannot be read as YAML documents)."""
    import yaml

    try:
        documents = list(yaml.safe_load_all(Path(path).read_text()))
    except (OSError, yaml.YAMLError):
        return None
    found = [d for d in documents if isinstance(d, dict) and d.get("kind") == "RayService"]
    return found[0] if len(found) == 1 else None
