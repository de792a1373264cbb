"""Reading a config file: YAML or JSON (a DeepSpeed ds_config.json is JSON) into a dict.

Duplicate keys are errors (both YAML and JSON would silently keep the last one), and syntax
errors name the file, line and column.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import yaml

from zerojax.config.checks import ConfigError


def read_config_file(source: str | os.PathLike) -> dict:
    """The file's top-level mapping: JSON for a `.json` suffix, YAML otherwise."""
    path = Path(source)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    if path.suffix == ".json":
        try:
            data = json.loads(text, object_pairs_hook=_json_pairs(path))
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{path}:{exc.lineno}:{exc.colno}: JSON syntax error: {exc.msg}"
            ) from exc
    else:
        try:
            loader = _StrictYamlLoader(text)
            loader.name = str(path)  # marks (and so duplicate-key errors) name the file
            try:
                data = loader.get_single_data()
            finally:
                loader.dispose()
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
            problem = exc.problem or "invalid YAML"
            if exc.context and exc.context_mark and exc.context_mark is not mark:
                cm = exc.context_mark
                problem += f" ({exc.context} at line {cm.line + 1}, column {cm.column + 1})"
            raise ConfigError(f"{where}: YAML syntax error: {problem}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: YAML error: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return dict(data)


def _json_pairs(path: Path):
    def hook(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise ConfigError(f"{path}: duplicate key {key!r}")
            seen[key] = value
        return seen

    return hook


class _StrictYamlLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys instead of keeping the last one."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            mark = key_node.start_mark
            raise ConfigError(
                f"{mark.name}:{mark.line + 1}:{mark.column + 1}: duplicate key {key!r}"
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictYamlLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping
)
