"""Every dotted path the docs name (``shardloader.presets.DatasetPreset``) works after a bare
``import shardloader``, as the top-level names do: in a fresh process, nothing else imported."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "DESIGN.md", *sorted((ROOT / "docs").glob("*.md"))]
PATH = re.compile(r"\bshardloader(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def documented() -> list[str]:
    found = {m.group(0) for doc in DOCS for m in PATH.finditer(doc.read_text())}
    return sorted(p for p in found if not p.endswith("._jpeg"))  # built only with libjpeg


def test_the_docs_name_dotted_paths():
    paths = documented()
    assert "shardloader.presets.DatasetPreset" in paths and len(paths) > 20


@pytest.mark.slow
@pytest.mark.subprocess
def test_every_documented_dotted_path_resolves_after_import_shardloader(tmp_path):
    code = (
        "import functools, sys, shardloader\n"
        "bad = []\n"
        "for p in sys.argv[1:]:\n"
        "    try:\n"
        "        functools.reduce(getattr, p.split('.')[1:], shardloader)\n"
        "    except AttributeError as err:\n"
        "        bad.append(f'{p}: {err}')\n"
        "print('\\n'.join(bad))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, *documented()],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,  # the installed package (or PYTHONPATH), not the current folder
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ""


MODULE_PATH = re.compile(r"shardloader/[A-Za-z0-9_/]*\.py")


def test_every_module_path_named_in_code_or_docs_exists():
    """A ``shardloader/...py`` path in a comment, NOTE, docstring or page is a pointer a reader
    follows: each must name a file that exists (modules move; their mentions must move too)."""
    files = [
        *(ROOT / "shardloader").rglob("*.py"),
        *(ROOT / "tests").rglob("*.py"),
        *(ROOT / "tools").rglob("*.py"),
        *(ROOT / "docs").rglob("*.md"),
        ROOT / "README.md",
        ROOT / "DESIGN.md",
        ROOT / "pyproject.toml",
    ]
    dangling = [
        f"{path.relative_to(ROOT)}:{number}: {match.group(0)}"
        for path in files
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        for match in MODULE_PATH.finditer(line)
        if not (ROOT / match.group(0)).exists()
    ]
    assert len(files) > 100 and dangling == []
