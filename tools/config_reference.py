"""The configuration reference page, generated from zerojax/config/schema.py.

    .venv/bin/python -m tools.config_reference            # writes docs/configuration.md
    .venv/bin/python -m tools.config_reference --check    # exit 1 naming undocumented fields

schema.py is parsed with `ast`, not imported: a field's documentation is the string literal
right after it (an attribute docstring), which the running dataclass does not keep. Every
config section (a field of `Config` whose type is a schema dataclass) gets a table of its
fields: name, type, default and that docstring; nested dataclasses (`precision.loss_scale`,
`rules[]`) get their own. The hand-written part of the page (what a config file looks like,
how it maps onto these classes) is tools/config_reference_template.md; the tables replace its
`<!-- config-sections -->` line.

The page is generated at build time (`make docs`) and not committed (docs/configuration.md is
git-ignored), so a schema change can never leave a stale page behind; tests/test_docs.py tests
the generator instead, and fails naming any field without a docstring.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "zerojax" / "config" / "schema.py"
TEMPLATE = pathlib.Path(__file__).resolve().parent / "config_reference_template.md"
PAGE = ROOT / "docs" / "configuration.md"
MARKER = "<!-- config-sections -->"
TOP = "Config"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Field:
    name: str
    type: str
    default: str | None
    """Source text of the default; None for a required field."""
    doc: str | None
    """The attribute docstring; None when the field has none."""
    in_file: bool = True
    """False for a field marked `metadata=NOT_IN_FILE`: set by the loader or by code, never a
    key of the config file."""


def _default(node: ast.expr | None, constants: dict[str, str]) -> str | None:
    if node is None:
        return None
    if isinstance(node, ast.Name) and node.id in constants:
        return constants[node.id]
    # field(default_factory=MeshConfig) -> "MeshConfig()"; field(metadata=...) -> required
    if _is_field_call(node):
        for keyword in node.keywords:
            if keyword.arg == "default_factory":
                return f"{ast.unparse(keyword.value)}()"
            if keyword.arg == "default":
                return _default(keyword.value, constants)
        return None
    return ast.unparse(node)


def _is_field_call(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "id", None) == "field"


def _in_file(node: ast.expr | None) -> bool:
    """False for `field(..., metadata=NOT_IN_FILE)` (or metadata saying `"in_file": False`)."""
    if not _is_field_call(node):
        return True
    for keyword in node.keywords:
        if keyword.arg == "metadata":
            text = ast.unparse(keyword.value)
            if text == "NOT_IN_FILE" or "'in_file': False" in text:
                return False
    return True


def parse_schema(source: str) -> dict[str, tuple[str | None, list[Field]]]:
    """Every dataclass of the schema source: class name -> (class docstring, fields in order)."""
    classes: dict[str, tuple[str | None, list[Field]]] = {}
    module = ast.parse(source).body
    # Module-level constants, so a default such as DEFAULT_MAX_REPLICATED_FRACTION shows its value.
    constants = {
        t.id: ast.unparse(node.value)
        for node in module
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    for node in module:
        if not isinstance(node, ast.ClassDef):
            continue
        if not any("dataclass" in ast.unparse(d) for d in node.decorator_list):
            continue
        fields = []
        body = node.body
        for i, stmt in enumerate(body):
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            after = body[i + 1] if i + 1 < len(body) else None
            doc = None
            if (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                doc = " ".join(after.value.value.split())
            fields.append(
                Field(
                    name=stmt.target.id,
                    type=ast.unparse(stmt.annotation),
                    default=_default(stmt.value, constants),
                    doc=doc or None,
                    in_file=_in_file(stmt.value),
                )
            )
        classes[node.name] = (ast.get_docstring(node), fields)
    return classes


def undocumented(classes: dict[str, tuple[str | None, list[Field]]]) -> list[str]:
    """`Class.field` for every field without an attribute docstring."""
    return [
        f"{name}.{f.name}" for name, (_, fields) in classes.items() for f in fields if not f.doc
    ]


def _referenced(type_text: str, classes: dict) -> list[str]:
    names = {n.id for n in ast.walk(ast.parse(type_text, mode="eval")) if isinstance(n, ast.Name)}
    return [c for c in classes if c in names]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(fields: list[Field]) -> list[str]:
    lines = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for f in fields:
        default = "required" if f.default is None else f"`{_cell(f.default)}`"
        doc = _cell(f.doc) if f.doc else "**undocumented**"
        if not f.in_file:
            doc = f"*Not a file key.* {doc}"
        lines.append(f"| `{f.name}` | `{_cell(f.type)}` | {default} | {doc} |")
    return lines


def render_sections(classes: dict[str, tuple[str | None, list[Field]]]) -> str:
    """The generated part of the page: the top-level keys, then one table per section."""
    top_doc, top = classes[TOP]
    lines = [f"## Top level (`{TOP}`)", "", *_about(top_doc), *_table(top), ""]
    done = {TOP}
    queue = [(_path("", f), c) for f in top for c in _referenced(f.type, classes)]
    while queue:
        path, name = queue.pop(0)
        if name in done:
            continue
        done.add(name)
        doc, fields = classes[name]
        lines += [f"## `{path}` (`{name}`)", "", *_about(doc), *_table(fields), ""]
        queue += [(_path(path, f), c) for f in fields for c in _referenced(f.type, classes)]
    orphans = [name for name in classes if name not in done]
    assert not orphans, f"schema dataclasses no config section reaches: {orphans}"
    return "\n".join(lines).rstrip() + "\n"


def _about(doc: str | None) -> list[str]:
    """A section's class docstring, its first paragraph, above its table."""
    if not doc:
        return []
    return [" ".join(doc.split("\n\n")[0].split()), ""]


def _path(parent: str, f: Field) -> str:
    # A tuple of dataclasses (`rules`) is a list in the file: `rules[]`.
    name = f"{parent}.{f.name}" if parent else f.name
    return f"{name}[]" if f.type.startswith("tuple[") else name


def render_page(schema: pathlib.Path = SCHEMA, template: pathlib.Path = TEMPLATE) -> str:
    text = template.read_text()
    assert MARKER in text, f"{template} has no {MARKER} line"
    return text.replace(MARKER, render_sections(parse_schema(schema.read_text())).rstrip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check every field's docstring")
    parser.add_argument("--out", type=pathlib.Path, default=PAGE)
    args = parser.parse_args(argv)
    missing = undocumented(parse_schema(SCHEMA.read_text()))
    if missing:
        print(f"fields without a docstring in {SCHEMA.relative_to(ROOT)}: {', '.join(missing)}")
    if args.check:
        return 1 if missing else 0
    args.out.write_text(render_page())
    print(f"{args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out} written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
