"""Print the measures of the core's weight and shape, read from the source (nothing imported
except, for the parameter count, ``shardloader.dataset``).

* code lines: lines holding a token that is not a comment, and not inside a docstring, of the
  streaming core (format, storage, plan, read, deliver, batching, codecs and the top-level
  modules) and of the whole package;
* planner probes: ``getattr``/``hasattr`` calls whose object is a planner;
* ShardedDataset's parameter count;
* two-way imports: pairs of subpackages that each import the other (anywhere in a module);
* dangling module paths: ``shardloader/...py`` named in code or docs that does not exist.

Usage: ``python tools/code_measures.py [--json]``.
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "shardloader"
CORE = ("format", "storage", "plan", "read", "deliver", "batching", "codecs")
PATH = re.compile(r"shardloader/[A-Za-z0-9_/]*\.py")
SKIP_TOKENS = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
}


def code_lines(path: Path) -> int:
    """Lines with code: not blank, not only comments, not part of a docstring."""
    text = path.read_text(encoding="utf-8")
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                end = body[0].end_lineno or body[0].lineno
                docstrings.update(range(body[0].lineno, end + 1))
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in SKIP_TOKENS:
            continue
        lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docstrings)


def in_core(path: Path) -> bool:
    rel = path.relative_to(PACKAGE).parts
    return len(rel) == 1 or rel[0] in CORE


def planner_probes() -> list[str]:
    """``getattr(x.planner, ...)``, ``hasattr(planner, ...)``, ``getattr(obj, "planner")``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(text)):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and node.args
            ):
                continue
            target = ast.unparse(node.args[0])
            named = len(node.args) > 1 and ast.unparse(node.args[1]) in ("'planner'", '"planner"')
            if re.search(r"\bplanner\b", target) and "getattr(" not in target or named:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def subpackage_imports() -> dict[str, set[str]]:
    """Which subpackages each subpackage imports (any import statement, deferred ones too)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).parts
        if len(rel) == 1:
            continue
        here = rel[0]
        mod = ["shardloader", *rel[:-1]] + ([] if rel[-1] == "__init__.py" else [rel[-1][:-3]])
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    pkg = mod if rel[-1] == "__init__.py" else mod[:-1]
                    base = pkg[: len(pkg) - node.level + 1]
                    names = [".".join([*base, *([node.module] if node.module else [])])]
                else:
                    names = [node.module or ""]
            for name in names:
                parts = name.split(".")
                if parts[0] != "shardloader" or len(parts) < 2:
                    continue
                if (PACKAGE / parts[1]).is_dir() and parts[1] != here:
                    graph.setdefault(here, set()).add(parts[1])
    return graph


def two_way_imports() -> list[str]:
    graph = subpackage_imports()
    return sorted(
        f"{a}<->{b}"
        for a, targets in graph.items()
        for b in targets
        if a < b and a in graph.get(b, ())
    )


def dangling_paths() -> list[str]:
    files = [
        *PACKAGE.rglob("*.py"),
        *(ROOT / "tests").rglob("*.py"),
        *(ROOT / "tools").rglob("*.py"),
        *(ROOT / "docs").rglob("*.md"),
        ROOT / "README.md",
        ROOT / "DESIGN.md",
        ROOT / "pyproject.toml",
    ]
    bad = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in PATH.finditer(line):
                if not (ROOT / match.group(0)).exists():
                    bad.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)}")
    return bad


def dataset_parameters() -> int:
    sys.path.insert(0, str(ROOT))
    from shardloader.dataset import ShardedDataset

    params = inspect.signature(ShardedDataset.__init__).parameters
    return sum(1 for p in params.values() if p.name != "self" and p.kind is not p.VAR_KEYWORD)


def measures() -> dict[str, object]:
    files = sorted(PACKAGE.rglob("*.py"))
    return {
        "core code lines": sum(code_lines(p) for p in files if in_core(p)),
        "package code lines": sum(code_lines(p) for p in files),
        "planner probes": len(planner_probes()),
        "ShardedDataset parameters": dataset_parameters(),
        "two-way imports": len(two_way_imports()),
        "dangling module paths": len(dangling_paths()),
    }


def main() -> None:
    result = measures()
    if "--json" in sys.argv:
        print(json.dumps(result))
        return
    for name, value in result.items():
        print(f"{name:28} {value}")
    if "-v" in sys.argv:
        print("probes:", *planner_probes(), sep="\n  ")
        print("two-way:", *two_way_imports(), sep="\n  ")
        print("dangling:", *dangling_paths(), sep="\n  ")


if __name__ == "__main__":
    main()
