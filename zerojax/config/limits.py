"""Bounds on what a config may be, and on how much of a value an error message shows.

A config is a few kilobytes of keys and numbers; anything far past that is a mistake (a
binary file given as a config, a generated file gone wrong) or an attack (a YAML alias bomb:
nine anchors of nine aliases each expand 492 bytes into a billion values). Each bound below
is checked before the work it protects, so such input costs milliseconds and raises a
`ConfigError`, never a `RecursionError`, a `MemoryError` or a hang:

- `MAX_FILE_BYTES`: a file is read up to this size, never further (`files`).
- `MAX_DEPTH`: nesting, checked while a YAML file is composed and while JSON brackets are
  counted, before any recursive parser or constructor runs (`files`), and on a dict given
  in code (`check_tree`).
- `MAX_VALUES`: values a config expands to, YAML aliases and merge keys counted as often as
  they are used, checked on the composed YAML graph before anything is constructed
  (`files`) and on a dict given in code (`check_tree`).
- `checks.MAX_RENDERED`: characters of a value an error message shows (`checks.render`).

`check_tree` also refuses non-finite numbers anywhere (YAML `.inf`/`.nan`, JSON
`Infinity`/`NaN`, and literals too large for a float such as `1.0e+309`, which both parsers
read as infinity): no learning rate, loss scale or clipping bound is meant to be one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from zerojax.config.checks import MAX_RENDERED, ConfigError, key_path, render

__all__ = ["MAX_DEPTH", "MAX_FILE_BYTES", "MAX_RENDERED", "MAX_VALUES", "check_tree"]

# 1 MiB: the largest configs in the field (MaxText's base.yml, ~1,400 lines) are ~60 KB, and
# PyYAML's pure-Python parser reads 1 MiB in seconds, not minutes.
MAX_FILE_BYTES = 1 << 20

# 64 levels: zerojax's deepest key is 4 levels down (zero_optimization.offload_optimizer.
# device under a `zerojax` key is 3); 64 leaves room for any DeepSpeed section while staying
# far below Python's recursion limit (1000), which the parsers would otherwise hit first.
MAX_DEPTH = 64

# 100,000 values: a 1 MiB file of short JSON numbers holds ~250,000, but a real config holds
# hundreds; an alias bomb is refused at its first expansion past this.
MAX_VALUES = 100_000


def check_tree(raw: Any, *, infinite_allowed: Iterable[str] = ()) -> None:
    """Refuse a config (the mapping a file or a caller gave) that nests deeper than
    `MAX_DEPTH`, expands to more than `MAX_VALUES` values (shared references counted each
    time they are used: a dict built in code can be a bomb too), contains itself, or holds a
    non-finite number, naming the key. `infinite_allowed`: key paths where +infinity means
    something (DeepSpeed's `steps_per_print: Infinity`, accelerate's "never print").

    Each distinct container is visited once (sizes and heights memoized by identity), so the
    check costs what the config holds, not what it would expand to."""
    allowed = frozenset(infinite_allowed)
    size: dict[int, int] = {}  # values under a container, itself included, fully expanded
    height: dict[int, int] = {}  # levels of containers under it, itself included
    on_path: set[int] = set()
    stack: list[tuple[Any, str, int, bool]] = [(raw, "", 0, False)]
    while stack:
        value, path, depth, children_done = stack.pop()
        if not isinstance(value, (Mapping, list, tuple)):
            _check_number(value, path, allowed)
            continue
        key = id(value)
        elements = list(value.values()) if isinstance(value, Mapping) else value
        if children_done:
            on_path.discard(key)
            nested = [e for e in elements if isinstance(e, (Mapping, list, tuple))]
            size[key] = 1 + len(elements) - len(nested) + sum(size[id(e)] for e in nested)
            height[key] = 1 + max((height[id(e)] for e in nested), default=0)
            if size[key] > MAX_VALUES:
                raise _too_many(path)
            continue
        if key in size:  # met before: its expansion counts again where it is used here
            if depth + height[key] > MAX_DEPTH:
                raise _too_deep(path)
            continue
        if key in on_path:
            raise ConfigError(f"{path or 'the config'}: contains itself; a config is a tree")
        if depth > MAX_DEPTH:
            raise _too_deep(path)
        if len(value) > MAX_VALUES:
            raise _too_many(path)
        on_path.add(key)
        stack.append((value, path, depth, True))
        if isinstance(value, Mapping):
            children = [(element, key_path(path, name)) for name, element in value.items()]
        else:
            children = [(element, f"{path}[{i}]") for i, element in enumerate(value)]
        stack.extend((element, where, depth + 1, False) for element, where in reversed(children))


def _check_number(value: Any, path: str, allowed: frozenset[str]) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        if value == math.inf and path in allowed:
            return
        raise ConfigError(
            f"{path or 'the config'}={render(value)}: not a finite number (YAML .inf or .nan, "
            "JSON Infinity or NaN, or a literal too large for a 64-bit float, such as "
            "1.0e+309); write a finite number"
        )


def _too_many(path: str) -> ConfigError:
    return ConfigError(
        f"{path or 'the config'}: expands to more than {MAX_VALUES:,} values (a shared "
        "reference repeated, or not a config); a config holds hundreds"
    )


def _too_deep(path: str) -> ConfigError:
    return ConfigError(
        f"{path}: nested deeper than {MAX_DEPTH} levels; a config nests a few levels"
    )
