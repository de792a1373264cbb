"""Value checks shared by every config dataclass and the loader: each returns the checked value
or raises a `ConfigError` that names the key path, the bad value and what is allowed.

A path is the field's dotted name (`zero.stage`); while `load_config` builds a config it names
the key the file wrote instead, where that differs (`zero_stage`, DeepSpeed's
`train_batch_size`): see `keys_written_as`.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any


class ConfigError(ValueError):
    """A config (or a sharding plan built from it) is invalid; the message says where and why."""


class ConfigWarning(UserWarning):
    """A config key is accepted but has no effect (DeepSpeed keys zerojax does not implement,
    batch sizes zerojax only checks), or a sharding rule matched no parameter."""


def _fmt(value: Any) -> str:
    return repr(value) if isinstance(value, str) else json.dumps(value, default=str)


_WRITTEN: ContextVar[Mapping[str, str] | None] = ContextVar(
    "zerojax_config_keys_written", default=None
)


@contextmanager
def keys_written_as(names: Mapping[str, str]) -> Iterator[None]:
    """Within the block, messages name each field path in `names` by the key the user wrote
    for it (`{"zero.stage": "zero_stage"}`): the loader builds the dataclasses, which check
    themselves, and the message must point at the file's key."""
    token = _WRITTEN.set({**(_WRITTEN.get() or {}), **names})
    try:
        yield
    finally:
        _WRITTEN.reset(token)


def written(path: str) -> str:
    """The key the user wrote for field path `path` (see `keys_written_as`); else `path`."""
    return (_WRITTEN.get() or {}).get(path, path)


def error(path: str, value: Any, problem: str) -> ConfigError:
    """`ConfigError("<path>=<value>: <problem>")`, the value as the user wrote it (JSON)."""
    return ConfigError(f"{written(path)}={_fmt(value)}: {problem}")


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


def as_axes(path: str, value: Any, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """An axis name or a list of them, each in `allowed`, none twice -> a tuple."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(a, str) for a in items):
        raise error(path, value, "expected a mesh axis name or a list of them")
    for i, axis in enumerate(items):
        as_choice(f"{path}[{i}]", axis, allowed)
    if len(set(items)) != len(items):
        raise error(path, value, "an axis may appear only once")
    return tuple(items)


def as_unit_interval(path: str, value: Any) -> float:
    value = as_float(path, value)
    if not 0 <= value < 1:
        raise error(path, value, "expected a number in [0, 1)")
    return value


def as_path(path: str, value: Any, *, optional: bool = False) -> str | None:
    """A non-empty path string (or, if `optional`, None)."""
    if optional and value is None:
        return None
    if not isinstance(value, str) or not value:
        raise error(path, value, "expected a path string" + (" or null" if optional else ""))
    return value


def as_regex(path: str, value: Any, what: str = "regex", *, show: bool = True) -> str:
    """A string `re.compile` accepts; the message names `what` it is, the value (unless `path`
    already shows it: `show=False`) and re's complaint."""
    try:
        re.compile(value)
    except (re.error, TypeError) as exc:
        shown = f" {value!r}" if show else ""
        raise ConfigError(f"{written(path)}: invalid {what}{shown}: {exc}") from exc
    return value


def as_stage(path: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in (0, 1, 2, 3):
        raise error(path, value, "allowed: 0, 1, 2, 3")
    return value
