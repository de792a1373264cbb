"""The docs site and README: generated pages, code blocks, paths.

    .venv/bin/python -m pytest -q tests/test_docs.py              # the cheap checks (< 5 s)
    .venv/bin/python -m pytest -q -m slow tests/test_docs.py      # also run every code block

Why it exists: docs rot silently. The cheap checks fail when a config field has no docstring
(the configuration reference is generated from them), when a code block is neither run nor
marked `<!-- not run: <reason> -->` (the reason may not be empty), and when a page names a
file of this repository that does not exist. The slow test runs every ```python block in a
fresh interpreter on 8 simulated CPU devices and loads every ```yaml block with
`zerojax.load_config`; `make docs` runs it after building the site.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import pytest
import yaml

from tools import config_reference

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GENERATED = DOCS / "configuration.md"
RUNNABLE = ("python", "yaml")
MARKER = re.compile(r"^<!--\s*not run:(?P<reason>.*?)-->$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,})(?P<lang>[\w+-]*)\s*$")
# A path into this repository, as pages cite them: zerojax/train/engine.py, tests/ckpt/, ...
REPO_PATH = re.compile(r"(?<![\w./-])((?:zerojax|tests|bench|examples|tools)/[\w./-]*[\w/])")
TIMEOUT_S = 600


@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    code: str
    not_run: str | None
    """The marker's reason; None when the block has no marker."""

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> dict[str, str]:
    """Every page whose blocks are checked: README, docs/*.md (the configuration reference as
    its generator renders it, since the page is built, not committed)."""
    out = {"README.md": (ROOT / "README.md").read_text()}
    for path in sorted(DOCS.glob("*.md")):
        if path != GENERATED:
            out[f"docs/{path.name}"] = path.read_text()
    out["docs/configuration.md"] = config_reference.render_page()
    return out


def code_blocks(page: str, text: str) -> list[Block]:
    lines = text.split("\n")
    blocks, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence = len(match["indent"]), match["fence"]
        end = i + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        assert end < len(lines), f"{page}:{i + 1}: code block never closed"
        previous = next((s.strip() for s in reversed(lines[:i]) if s.strip()), "")
        marker = MARKER.match(previous)
        code = "\n".join(s[indent:] for s in lines[i + 1 : end])
        blocks.append(
            Block(page, i + 1, match["lang"], code, marker["reason"].strip() if marker else None)
        )
        i = end + 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for page, text in pages().items() for b in code_blocks(page, text)]


def test_every_config_field_has_a_docstring():
    """The configuration reference is these docstrings; a field without one is undocumented."""
    classes = config_reference.parse_schema(config_reference.SCHEMA.read_text())
    missing = config_reference.undocumented(classes)
    assert not missing, f"zerojax/config/schema.py fields without a docstring: {missing}"


def test_configuration_reference_lists_every_field():
    classes = config_reference.parse_schema(config_reference.SCHEMA.read_text())
    page = config_reference.render_page()
    assert config_reference.MARKER not in page
    for name, (_, fields) in classes.items():
        assert f"(`{name}`)" in page or name == config_reference.TOP, name
        for field in fields:
            assert f"| `{field.name}` | `" in page, f"{name}.{field.name} missing from the page"


def test_parse_schema_reads_attribute_docstrings():
    source = (
        "@dataclass(frozen=True)\nclass Config:\n    a: int = 1\n    '''The a.'''\n\n"
        "    b: str | None = None\n\n    def f(self):\n        '''not a field'''\n"
        "    c: str = field(metadata=NOT_IN_FILE)\n    '''Set by the loader.'''\n"
        "    d: float = field(default=LIMIT, metadata=NOT_IN_FILE)\n    '''Limit.'''\n"
    )
    classes = config_reference.parse_schema("LIMIT = 0.5\n" + source)
    a, b, c, d = classes["Config"][1]
    assert (a.name, a.type, a.default, a.doc, a.in_file) == ("a", "int", "1", "The a.", True)
    assert (b.name, b.type, b.default, b.doc) == ("b", "str | None", "None", None)
    assert (c.name, c.default, c.doc, c.in_file) == ("c", None, "Set by the loader.", False)
    assert (d.name, d.default, d.in_file) == ("d", "0.5", False)
    assert config_reference.undocumented(classes) == ["Config.b"]


def test_every_code_block_is_run_or_marked_with_a_reason():
    unmarked, empty = [], []
    for block in all_blocks():
        if block.not_run is None and block.lang not in RUNNABLE:
            unmarked.append(f"{block.id} ({block.lang or 'no language'})")
        if block.not_run == "":
            empty.append(block.id)
    assert not empty, f"`<!-- not run: -->` markers without a reason: {empty}"
    assert not unmarked, (
        f"code blocks neither run (```python, ```yaml) nor marked "
        f"`<!-- not run: <reason> -->`: {unmarked}"
    )


def test_every_marker_precedes_a_code_block():
    orphans = []
    for page, text in pages().items():
        marked = {b.line for b in code_blocks(page, text) if b.not_run is not None}
        lines = text.split("\n")
        for i, line in enumerate(lines):
            if MARKER.match(line.strip()):
                nxt = next((j for j in range(i + 1, len(lines)) if lines[j].strip()), None)
                if nxt is None or nxt + 1 not in marked:
                    orphans.append(f"{page}:{i + 1}")
    assert not orphans, f"`not run` markers not right before a code block: {orphans}"


def test_marker_parsing():
    text = "x\n<!-- not run: needs a GPU -->\n```bash\nrun\n```\n\n  <!-- not run: -->\n  ```\n  y\n  ```\n"
    first, second = code_blocks("t.md", text)
    assert (first.lang, first.not_run, first.code) == ("bash", "needs a GPU", "run")
    assert (second.lang, second.not_run, second.code, second.line) == ("", "", "y", 8)


def test_repository_paths_exist():
    """A page citing a module that moved or never existed (`sharding/step.py`) misleads."""
    missing = set()
    for page, text in pages().items():
        for path in REPO_PATH.findall(text):
            if not (ROOT / path.rstrip("/.")).exists():
                missing.add(f"{page}: {path}")
    assert not missing, f"paths that do not exist: {sorted(missing)}"


def test_package_layout_names_existing_modules():
    """The design page's directory map names modules without their directory: each must be in
    the directory its line group starts with (a module that moved must move there too)."""
    layout = next(
        b.code
        for b in code_blocks("docs/design.md", pages()["docs/design.md"])
        if b.lang == "text" and "zerojax/bridge/" in b.code
    )
    directory, missing = None, []
    for line in layout.split("\n"):
        head = line.split(" ", 1)[0]
        if head:
            directory = head if head.endswith("/") else head.rsplit("/", 1)[0] + "/"
        for name in re.findall(r"(?<![\w/{,<.])(\w+\.py)\b", line.removeprefix(head)):
            if not (ROOT / directory / name).exists():
                missing.append(f"{directory}{name}")
    assert not missing, f"docs/design.md's layout names modules that do not exist: {missing}"


def test_readme_links_resolve():
    """README's links into docs/ must work on a repository browser, where the site is not built."""
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if "://" not in t]
    assert local, "README links to none of the docs pages"
    broken = [t for t in local if not (ROOT / t).exists()]
    assert not broken, f"README links to files that are not in the repository: {broken}"


def test_nav_pages_exist():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    files = [next(iter(entry.values())) for entry in config["nav"]]
    absent = [f for f in files if not (DOCS / f).exists() and DOCS / f != GENERATED]
    assert not absent, f"mkdocs.yml nav pages missing from docs/: {absent}"
    unlisted = {p.name for p in DOCS.glob("*.md")} - set(files)
    assert not unlisted, f"pages in docs/ that mkdocs.yml's nav leaves out: {unlisted}"


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


PYTHON_BLOCKS = [b for b in all_blocks() if b.lang == "python" and b.not_run is None]
YAML_BLOCKS = [b for b in all_blocks() if b.lang == "yaml" and b.not_run is None]


@pytest.mark.slow
@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.id for b in PYTHON_BLOCKS])
def test_python_block_runs(block: Block):
    result = _run(block.code)
    assert result.returncode == 0, (
        f"{block.id} failed (exit {result.returncode}):\n{block.code}\n"
        f"--- stderr ---\n{result.stderr[-4000:]}"
    )


@pytest.mark.slow
def test_yaml_blocks_load():
    """Every yaml block is a config `zerojax.load_config` accepts (one interpreter for all)."""
    configs = {b.id: yaml.safe_load(b.code) for b in YAML_BLOCKS}
    code = (
        "import sys, yaml, zerojax\n"
        f"for where, raw in {configs!r}.items():\n"
        "    try:\n"
        "        zerojax.load_config(raw)\n"
        "    except Exception as e:\n"
        "        sys.exit(f'{where}: {type(e).__name__}: {e}')\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr[-4000:]
