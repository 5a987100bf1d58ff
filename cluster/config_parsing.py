"""How plain data (a YAML file's content, a Serve config's `args`) becomes a config, through
pydantic, and the JSON schema of such a file.

A config is a tree of frozen stdlib dataclasses, each checking its own values in
`__post_init__` (so configs built in Python are checked too). The root class carries
`@with_config(PARSING)`, which pydantic applies to every class inside it: unknown keys are
rejected and types are strict ("4" is not a number, 1 is not true). `parse` reports every
problem at once as a ConfigError, each led by its key's path (`verifier.max_sesions: unknown
key`); `json_schema` describes the file, with each field's docstring and default.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import json
import textwrap
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ConfigDict, TypeAdapter, ValidationError
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import ErrorDetails, core_schema

from cluster.runtime.errors import InvalidArgumentError

T = TypeVar("T")

PARSING = ConfigDict(extra="forbid", strict=True)
"""How a config file is parsed; set on the root class with `pydantic.with_config`."""


class ConfigError(InvalidArgumentError):
    """A config that does not validate: `problems` holds each problem, led by its key's path."""

    def __init__(self, *problems: str) -> None:
        super().__init__(*problems)  # the args: what pickling (a Ray Serve error) carries
        self.problems = problems

    def __str__(self) -> str:
        return "; ".join(self.problems)


def parse(cls: type[T], data: object) -> T:
    """`cls` built from `data`; raises ConfigError listing every problem found."""
    try:
        # Through JSON, so that strict mode takes a mapping for a config class and a list for a
        # tuple, as YAML gives them, while "4" stays a string. YAML's dates and such: strings.
        text = json.dumps(data, default=str)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"config is not plain data: {error}") from error
    try:
        config: T = _adapter(cls).validate_json(text)
    except ValidationError as error:
        raise ConfigError(*(_problem(cls, detail) for detail in error.errors())) from error
    return config


def load_yaml(path: str | Path) -> Any:
    """A YAML file's content (an empty file: an empty mapping)."""
    import yaml

    try:
        return yaml.safe_load(Path(path).read_text()) or {}
    except OSError as error:
        raise InvalidArgumentError(f"cannot read config {path}: {error}") from error
    except yaml.YAMLError as error:
        raise InvalidArgumentError(f"config {path} is not valid YAML: {error}") from error


def json_schema(cls: type) -> dict[str, Any]:
    """The JSON schema of a config file whose root is `cls`."""
    schema = _adapter(cls).json_schema(schema_generator=_Documented)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


_adapters: dict[type, TypeAdapter[Any]] = {}


def _adapter(cls: type) -> TypeAdapter[Any]:
    # Built on first use, not on import (it reads every config class), then kept.
    if cls not in _adapters:
        _adapters[cls] = TypeAdapter(cls)
    return _adapters[cls]


_EXPECTED = {
    "bool_type": "true or false",
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "list_type": "a list",
    "tuple_type": "a list",
    "dict_type": "a mapping",
    "dataclass_type": "a mapping",
}
"""What a value of the wrong type should have been, by pydantic error type, in YAML's words."""

_SECRET_KEYS = frozenset({"cluster_secret"})
"""Keys whose values never appear in an error message."""


def _problem(root: type, detail: ErrorDetails) -> str:
    """One pydantic error as `path: what is wrong`."""
    loc = detail["loc"]
    path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)
    path = path.removeprefix(".")
    kind = detail["type"]
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        return f"{path}: unknown key (known: {', '.join(_keys_at(root, loc[:-1]))})"
    if kind in ("missing", "missing_argument"):
        return f"{path}: required"
    if kind == "value_error":  # a config class's own check: its message names the field
        message = str(detail.get("ctx", {}).get("error", detail["msg"]))
        return f"{path}: {message}" if path else message
    path = path or "config"
    if kind in _EXPECTED:
        got = "" if _SECRET_KEYS.intersection(map(str, loc)) else f", got {detail['input']!r}"
        return f"{path} must be {_EXPECTED[kind]}{got}"
    return f"{path}: {detail['msg']}"


def _keys_at(root: type, loc: tuple[int | str, ...]) -> list[str]:
    """The keys the mapping at `loc` takes: the fields of the config class found there."""
    hint: Any = root
    for part in loc:  # a name: that field's type; an index: the item type of a tuple field
        hint = (
            typing.get_args(hint)[0] if isinstance(part, int) else typing.get_type_hints(hint)[part]
        )
    return sorted(f.name for f in dataclasses.fields(hint))


class _Documented(GenerateJsonSchema):
    """Each field described by its docstring, its base class's included (pydantic's
    `use_attribute_docstrings` reads the class's own source only), and defaults made by a
    factory shown too (`prompt_lookup` is on by default, unlike a bare NgramConfig)."""

    def dataclass_schema(self, schema: core_schema.DataclassSchema) -> JsonSchemaValue:
        json_schema = super().dataclass_schema(schema)
        docs = _attribute_docs(schema["cls"])
        for name, field_schema in json_schema.get("properties", {}).items():
            if name in docs:
                field_schema.setdefault("description", docs[name])
        return json_schema

    def get_default_value(self, schema: core_schema.WithDefaultSchema) -> Any:
        factory = schema.get("default_factory")
        if factory is not None and not schema.get("default_factory_takes_data"):
            return typing.cast(Callable[[], Any], factory)()
        return super().get_default_value(schema)


def _attribute_docs(cls: type) -> dict[str, str]:
    """The docstrings under a dataclass's fields, its dataclass bases' included, by field."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(base):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        except (OSError, TypeError):  # no source to read (a class made at run time)
            continue
        body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs
