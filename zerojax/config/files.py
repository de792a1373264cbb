"""Reading a config file: YAML or JSON (a DeepSpeed ds_config.json is JSON) into a dict.

Duplicate keys are errors (both YAML and JSON would silently keep the last one), and syntax
errors name the file, line and column. YAML merge keys (`<<: *base`) merge as YAML defines
them: the mapping's own keys win over merged ones, and only its own keys count as duplicates.

Whatever the file holds, reading it ends quickly in a dict or a `ConfigError` naming the file
(`limits` has the bounds and why): it is read up to `MAX_FILE_BYTES`; bytes that are not
UTF-8 are named by offset; nesting is bounded while a YAML file is composed and by counting
JSON brackets, before either parser recurses; a YAML file's aliases and merge keys are
counted as often as they are used on the composed node graph, before anything is
constructed, so an alias bomb never expands.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import yaml

from zerojax.config.checks import ConfigError, render
from zerojax.config.limits import MAX_DEPTH, MAX_FILE_BYTES, MAX_VALUES


def read_config_file(source: str | os.PathLike) -> dict:
    """The file's top-level mapping: JSON for a `.json` suffix, YAML otherwise."""
    path = Path(source)
    text = _read_text(path)
    if path.suffix == ".json":
        data = _parse_json(path, text)
    else:
        data = _parse_yaml(path, text)
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return dict(data)


def _read_text(path: Path) -> str:
    try:
        with path.open("rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)  # never more: the path may be /dev/zero
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(
            f"{path}: larger than {MAX_FILE_BYTES:,} bytes; a config file is a few kilobytes "
            "(is this the right file?)"
        )
    try:
        return data.decode("utf-8-sig")  # -sig: a byte-order mark some editors write is fine
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: byte {exc.start} (0x{data[exc.start]:02x}) is not UTF-8 text: a config "
            "file is YAML or JSON text (is this a binary file?)"
        ) from None


# A JSON string (escapes included) or a bracket: strings are skipped so brackets inside them
# do not count.
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _parse_json(path: Path, text: str) -> object:
    depth = 0
    for match in _JSON_TOKENS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise ConfigError(
                    f"{path}:{_line_column(text, match.start())}: nested deeper than "
                    f"{MAX_DEPTH} levels; a config nests a few levels"
                )
        elif token in "]}":
            depth -= 1
    try:
        return json.loads(text, object_pairs_hook=_json_pairs(path))
    except ConfigError:
        raise
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}:{exc.colno}: JSON syntax error: {exc.msg}") from exc
    except ValueError as exc:  # e.g. an integer literal past Python's 4,300-digit limit
        raise ConfigError(f"{path}: JSON error: {_first_clause(exc)}") from None


def _first_clause(exc: ValueError) -> str:
    """Python's int-size message without its advice to raise the limit."""
    return str(exc).split(";")[0]


def _line_column(text: str, offset: int) -> str:
    line = text.count("\n", 0, offset) + 1
    return f"{line}:{offset - (text.rfind(chr(10), 0, offset) + 1) + 1}"


def _json_pairs(path: Path):
    def hook(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise ConfigError(f"{path}: duplicate key {render(key)}")
            seen[key] = value
        return seen

    return hook


def _parse_yaml(path: Path, text: str) -> object:
    try:
        loader = _ConfigYamlLoader(text, path)
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except ConfigError:
        raise
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = exc.problem or "invalid YAML"
        if exc.context and exc.context_mark and exc.context_mark is not mark:
            cm = exc.context_mark
            problem += f" ({exc.context} at line {cm.line + 1}, column {cm.column + 1})"
        raise ConfigError(f"{where}: YAML syntax error: {problem}") from exc
    except yaml.reader.ReaderError as exc:  # its str() names libyaml's "<unicode string>"
        char = exc.character if isinstance(exc.character, int) else ord(exc.character)
        raise ConfigError(
            f"{path}: character {exc.position}: YAML error: {exc.reason} (#x{char:04x})"
        ) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: YAML error: {exc}") from exc
    except ValueError as exc:  # e.g. an integer literal past Python's 4,300-digit limit
        raise ConfigError(f"{path}: YAML error: {_first_clause(exc)}") from None


# libyaml's parser (PyYAML's CParser) where PyYAML has it: it scans 1 MiB in ~0.1 s, the
# pure-Python one in ~20 s. Either way the composer is PyYAML's Python one, so the depth and
# size bounds below apply while composing.
try:
    from yaml.cyaml import CParser

    _PARSER: tuple[type, ...] = (CParser,)
except ImportError:  # pragma: no cover - PyYAML built without libyaml
    _PARSER = (yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser)


class _ConfigYamlLoader(
    yaml.composer.Composer, *_PARSER, yaml.constructor.SafeConstructor, yaml.resolver.Resolver
):
    """SafeLoader's pieces (libyaml's parser where present) with bounds: nesting is bounded
    and nodes counted while composing, the composed graph is counted with aliases and merges
    expanded before anything is constructed, and duplicate keys are errors instead of the last
    one silently winning."""

    def __init__(self, text: str, path: Path) -> None:
        _PARSER[0].__init__(self, text)  # the reader (or libyaml) takes the text
        for base in _PARSER[1:]:
            base.__init__(self)
        yaml.composer.Composer.__init__(self)
        yaml.constructor.SafeConstructor.__init__(self)
        yaml.resolver.Resolver.__init__(self)
        self._path = path
        self._depth = 0
        self._composed = 0
        self._checked_keys: set[int] = set()

    def _where(self, mark) -> str:
        return f"{self._path}:{mark.line + 1}:{mark.column + 1}"

    def compose_node(self, parent, index):
        # The composer recurses once per level: stop before Python's recursion limit does,
        # and count what it builds (aliases are counted when the graph is complete).
        self._depth += 1
        self._composed += 1
        try:
            if self._depth > MAX_DEPTH or self._composed > MAX_VALUES:
                problem = (
                    f"nested deeper than {MAX_DEPTH} levels; a config nests a few levels"
                    if self._depth > MAX_DEPTH
                    else f"more than {MAX_VALUES:,} values; a config holds hundreds"
                )
                raise ConfigError(f"{self._where(self.peek_event().start_mark)}: {problem}")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None:
            _check_expanded_size(node, self._where)
        return node

    def flatten_mapping(self, node):
        # Before the merge keys are flattened into the mapping: only its own keys may clash
        # (a merged key is meant to be overridden). Each node once: flattening rewrites it.
        if id(node) not in self._checked_keys:
            self._checked_keys.add(id(node))
            self._refuse_duplicate_keys(node)
        super().flatten_mapping(node)

    def _refuse_duplicate_keys(self, node: yaml.MappingNode) -> None:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # unhashable: construct_mapping names it with its mark
                continue
            if duplicate:
                raise ConfigError(
                    f"{self._where(key_node.start_mark)}: duplicate key {render(key)}"
                )


def _check_expanded_size(root: yaml.Node, where) -> None:
    """Refuse a node graph that, with every alias (and merge key) expanded where it is used,
    holds more than MAX_VALUES nodes or nests deeper than MAX_DEPTH, or that contains itself.
    Sizes are memoized per node, so the count costs one visit per distinct node, however
    large the expansion it refuses."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            children = _children(node)
            size[key] = 1 + sum(size[id(child)] for child in children)
            depth[key] = 1 + max((depth[id(child)] for child in children), default=0)
            if size[key] > MAX_VALUES:
                raise ConfigError(
                    f"{where(node.start_mark)}: this value expands to more than "
                    f"{MAX_VALUES:,} values with its YAML aliases expanded (an alias bomb?); "
                    "a config holds hundreds"
                )
            if depth[key] > MAX_DEPTH:
                raise ConfigError(
                    f"{where(node.start_mark)}: nested deeper than {MAX_DEPTH} levels through "
                    "YAML aliases; a config nests a few levels"
                )
            continue
        if key in size:
            continue
        if key in on_path:
            raise ConfigError(
                f"{where(node.start_mark)}: a YAML alias refers to a value that contains it "
                "(a recursive structure); a config is a tree"
            )
        on_path.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in size)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []
