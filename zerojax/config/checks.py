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


# Characters of a value shown in a message: enough for any list a config means, and a bound
# on what a message costs whatever the value (a 10 MB string, a shared-reference bomb).
MAX_RENDERED = 200


class _Full(Exception):
    """The rendering reached its budget: stop walking the value."""


def render(value: Any, limit: int = MAX_RENDERED) -> str:
    """`value` as a message shows it: a string in Python quotes, anything else as JSON
    (`json.dumps`'s spelling: true, null, [1, 2], {"a": 1}), cut after about `limit`
    characters with "..." (the walk stops there, so its cost is bounded too)."""
    if isinstance(value, str):
        return repr(value) if len(value) <= limit else f"{value[:limit]!r}..."
    pieces: list[str] = []
    size = 0

    def put(text: str) -> None:
        nonlocal size
        pieces.append(text)
        size += len(text)
        if size > limit:
            raise _Full

    def walk(item: Any) -> None:
        if isinstance(item, Mapping):
            put("{")
            for i, (key, element) in enumerate(item.items()):
                put(", " if i else "")
                put(_scalar(key if isinstance(key, str) else str(key), limit))
                put(": ")
                walk(element)
            put("}")
        elif isinstance(item, (list, tuple)):
            put("[")
            for i, element in enumerate(item):
                put(", " if i else "")
                walk(element)
            put("]")
        else:
            put(_scalar(item, limit))

    try:
        walk(value)
    except _Full:
        return "".join(pieces)[:limit] + "..."
    return "".join(pieces)


def _scalar(value: Any, limit: int) -> str:
    if value is None or isinstance(value, (bool, float)):
        return json.dumps(value)
    if isinstance(value, int):
        # str() of an int over 4,300 digits raises (Python's own guard); its size is the point.
        return (
            json.dumps(value)
            if value.bit_length() <= 256
            else f"<a {value.bit_length()}-bit integer>"
        )
    text = value if isinstance(value, str) else str(value)
    return json.dumps(text[:limit])


def key_path(path: str, key: Any) -> str:
    """`path.key` (the key cut to a readable length)."""
    name = key if isinstance(key, str) else render(key)
    name = name if len(name) <= 80 else name[:80] + "..."
    return f"{path}.{name}" if path else name


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
    """`ConfigError("<path>=<value>: <problem>")`, the value as the user wrote it (JSON, cut
    at MAX_RENDERED characters: see `render`)."""
    return ConfigError(f"{written(path)}={render(value)}: {problem}")


def check_keys(
    path: str,
    mapping: Mapping,
    allowed: tuple[str, ...],
    *,
    also_known: tuple[str, ...] = (),
    listed: str | None = None,
) -> None:
    """Unknown keys are errors, with a did-you-mean: a typo must never be a silent default.

    `also_known`: keys that are handled elsewhere (DeepSpeed's keys beside a zerojax file's):
    a key close to one of them gets that hint when none of `allowed` is closer. `listed`
    replaces the list of allowed keys in the message (for sections with dozens)."""
    for key in mapping:
        if key not in allowed:
            close = did_you_mean(key, allowed) or did_you_mean(key, also_known)
            hint = f" (did you mean {close!r}?)" if close else ""
            listed_keys = listed if listed is not None else f"allowed keys: {', '.join(allowed)}"
            raise ConfigError(f"{key_path(path, key)}: unknown key{hint}; {listed_keys}")


def did_you_mean(key: Any, known: tuple[str, ...], cutoff: float = 0.6) -> str | None:
    """The known key closest to `key` (difflib's ratio >= `cutoff`), if any."""
    if not isinstance(key, str) or not known:
        return None
    others = [name for name in known if name != key]
    close = difflib.get_close_matches(
        key[:100], others, n=1, cutoff=cutoff
    )  # bounded: difflib is quadratic
    return close[0] if close else None


def as_mapping(path: str, value: Any) -> Mapping:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise error(path, value, "expected a mapping of keys to values")
    return value


INT32_MAX = 2**31 - 1
"""The largest count a program holds as int32 (loss-scale window and hysteresis)."""


def as_int(path: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(path, value, "expected an integer" + (f" >= {minimum}" if minimum else ""))
    if minimum is not None and value < minimum:
        raise error(path, value, f"expected an integer >= {minimum}")
    if maximum is not None and value > maximum:
        low = f"between {minimum} and" if minimum is not None else "at most"
        raise error(path, value, f"expected an integer {low} {maximum}")
    return value


def as_float(
    path: str, value: Any, *, positive: bool = False, at_most: float | None = None
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(path, value, "expected a number")
    try:
        number = float(value)
    except OverflowError:  # an integer past 1.8e308
        number = math.inf
    if not math.isfinite(number):
        raise error(path, value, "expected a finite number")
    if positive and number <= 0:
        raise error(path, value, "expected a number > 0")
    if at_most is not None and not 0 <= number <= at_most:
        raise error(path, value, f"expected a number between 0 and {at_most}")
    return number


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
    # RecursionError and OverflowError: re's own limits on nesting and compiled size.
    except (re.error, TypeError, RecursionError, OverflowError) as exc:
        shown = f" {render(value)}" if show else ""
        raise ConfigError(f"{written(path)}: invalid {what}{shown}: {exc}") from exc
    return value


def as_stage(path: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in (0, 1, 2, 3):
        raise error(path, value, "allowed: 0, 1, 2, 3")
    return value
