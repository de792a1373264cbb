"""Value checks shared by every section parser: each returns the checked value or raises a
`ConfigError` that names the key path, the bad value and what is allowed."""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Mapping
from typing import Any

from zerojax.config.schema import MESH_AXES


class ConfigError(ValueError):
    """A config (or a sharding plan built from it) is invalid; the message says where and why."""


class ConfigWarning(UserWarning):
    """A config key is accepted but has no effect (DeepSpeed keys zerojax does not implement,
    batch sizes zerojax only checks), or a sharding rule matched no parameter."""


def _fmt(value: Any) -> str:
    return repr(value) if isinstance(value, str) else json.dumps(value, default=str)


def error(path: str, value: Any, problem: str) -> ConfigError:
    """`ConfigError("<path>=<value>: <problem>")`, the value as the user wrote it (JSON)."""
    return ConfigError(f"{path}={_fmt(value)}: {problem}")


def check_keys(path: str, mapping: Mapping, allowed: tuple[str, ...]) -> None:
    """Unknown keys are errors, with a did-you-mean: a typo must never be a silent default."""
    for key in mapping:
        if key not in allowed:
            where = f"{path}.{key}" if path else str(key)
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: unknown key{hint}; allowed keys: {', '.join(allowed)}")


def as_mapping(path: str, value: Any) -> Mapping:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise error(path, value, "expected a mapping of keys to values")
    return value


def as_int(path: str, value: Any, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(path, value, "expected an integer" + (f" >= {minimum}" if minimum else ""))
    if minimum is not None and value < minimum:
        raise error(path, value, f"expected an integer >= {minimum}")
    return value


def as_float(
    path: str, value: Any, *, positive: bool = False, at_most: float | None = None
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise error(path, value, "expected a number")
    if positive and value <= 0:
        raise error(path, value, "expected a number > 0")
    if at_most is not None and not 0 <= value <= at_most:
        raise error(path, value, f"expected a number between 0 and {at_most}")
    return float(value)


def as_bool(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise error(path, value, "expected true or false")
    return value


def as_choice(path: str, value: Any, allowed: tuple, *, optional: bool = False) -> Any:
    if optional and value is None:
        return None
    if value not in allowed:
        choices = ", ".join(map(str, allowed)) + (", null" if optional else "")
        raise error(path, value, f"allowed: {choices}")
    return value


def as_axes(path: str, value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(a, str) for a in items):
        raise error(path, value, "expected a mesh axis name or a list of them")
    for i, axis in enumerate(items):
        as_choice(f"{path}[{i}]", axis, MESH_AXES)
    if len(set(items)) != len(items):
        raise error(path, value, "an axis may appear only once")
    return tuple(items)


def as_stage(path: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in (0, 1, 2, 3):
        raise error(path, value, "allowed: 0, 1, 2, 3")
    return value
