"""docs/architecture.md is the project's map: every path its Layout section names exists,
and the README links to it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def layout_paths(text: str) -> list[str]:
    """The backticked path that starts each bullet of the `## Layout` section."""
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^- `([^`]+)`", section, flags=re.MULTILINE)


def test_every_path_the_layout_names_exists() -> None:
    paths = layout_paths(DOC.read_text())
    assert len(paths) >= 20  # the section is there and was read
    assert [p for p in paths if not (ROOT / p).exists()] == []


def test_the_check_sees_a_path_that_does_not_exist() -> None:
    doc = ("# Title\n\n## Layout\n\n- `pd/` — here\n- `proxy/routing.py` — gone\n\n"
           "## Interfaces\n- `nope/` — not layout\n")
    paths = layout_paths(doc)
    assert paths == ["pd/", "proxy/routing.py"]
    assert [p for p in paths if not (ROOT / p).exists()] == ["proxy/routing.py"]


def test_the_readme_links_the_architecture_document() -> None:
    assert "docs/architecture.md" in (ROOT / "README.md").read_text()


def imports_ours(path: Path) -> bool:
    """Whether the module imports `pd` or `connectors` (anywhere in it: lazily too)."""
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(name.split(".")[0] in ("pd", "connectors") for name in names):
            return True
    return False


def test_the_benchmarks_that_import_pd_are_the_ones_the_document_names() -> None:
    """The Testing section lists the benchmarks that run a part of ours in-process (or use
    `pd` as a tool); every other benchmark talks HTTP only."""
    importers = {path.stem for path in (ROOT / "benchmarks").glob("*.py") if imports_ours(path)}
    paragraph = DOC.read_text().split("`benchmarks/` talk to servers over HTTP", 1)[1].split("\n\n", 1)[0]
    named = set(re.findall(r"`(?:benchmarks/)?(\w+)\.py`", paragraph))
    assert importers == named
