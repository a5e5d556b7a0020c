"""The tests' scaffolding exists once: shards written by hand come from ``tools/synthetic.py``,
local HTTP servers start through ``tests/http_server.py``, torchrun jobs through
``helpers.torchrun``; and ``tools/`` never imports ``tests/`` (the tests may import a tool's
module, so a helper both need lives in ``tools/``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS, TOOLS = ROOT / "tests", ROOT / "tools"


def _modules(*folders: Path) -> dict[str, ast.Module]:
    return {
        str(path.relative_to(ROOT)): ast.parse(path.read_text(encoding="utf-8"), str(path))
        for folder in folders
        for path in sorted(folder.glob("*.py"))
    }


def _called(node: ast.AST) -> set[str]:
    """Names of what ``node`` calls (``f(...)`` and ``x.f(...)`` both give ``f``)."""
    out = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            fn = call.func
            out.add(fn.id if isinstance(fn, ast.Name) else getattr(fn, "attr", ""))
    return out


def test_tools_never_import_tests():
    ours = {p.stem for p in TESTS.glob("*.py")}
    offenders = []
    for name, tree in _modules(TOOLS).items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names if a.name.split(".")[0] in ours]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found = [node.module] if node.module.split(".")[0] in ours else []
            else:
                continue
            offenders += [f"{name}:{node.lineno} imports {m}" for m in found]
    assert offenders == []
    assert "synthetic" not in ours  # tools/synthetic.py is importable beside tests/ modules


def test_a_shard_and_its_sidecar_are_written_by_hand_in_one_place():
    """A function that serialises a writer's sidecar and builds the manifest entry for it is a
    copy of ``tools/synthetic.write_shard`` (tests, tools and the benchmarks had eight)."""
    offenders = [
        f"{name}:{fn.lineno} {fn.name}"
        for name, tree in _modules(TESTS, TOOLS).items()
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef) and {"ShardInfo", "to_arrow_bytes"} <= _called(fn)
    ]
    assert offenders == ["tools/synthetic.py:30 write_shard"]


def test_local_http_servers_and_torchrun_jobs_start_in_one_place():
    where = {"ThreadingHTTPServer": set(), "torchrun": set()}
    for name, tree in _modules(TESTS).items():
        if name == "tests/test_scaffolding.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "ThreadingHTTPServer":
                where["ThreadingHTTPServer"].add(name)
            if isinstance(node, ast.Constant) and node.value == "--standalone":
                where["torchrun"].add(name)  # a torchrun command line of one machine
    assert where == {
        "ThreadingHTTPServer": {"tests/http_server.py"},
        "torchrun": {"tests/helpers.py", "tests/test_examples.py"},  # examples: the README's
    }
