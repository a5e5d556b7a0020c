"""The package's shape: no import circles, small modules, ShardedDataset's state via methods.

Read from the source with ``ast`` (nothing is imported), so a circle is caught even where import
order happens to make it work today.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "shardloader"

# Circles allowed, each as the set of modules it lies within: none left.
KNOWN_CIRCLES: list[set[str]] = []
# Circles closed only by imports inside functions (deferred): they work, but hide a tangle
# like the old batching <-> collate one.  None left.
KNOWN_DEFERRED_CIRCLES: list[set[str]] = [*KNOWN_CIRCLES]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(body: list[ast.stmt], deferred: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements that run: module level (in ifs, trys and withs), and with
    ``deferred`` also those inside functions and classes; never ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node):
                yield from _imports(node.body, deferred)
            yield from _imports(node.orelse, deferred)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _imports(block, deferred)
        elif isinstance(node, (ast.With, ast.For, ast.While)):
            yield from _imports(node.body, deferred)
        elif deferred and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from _imports(node.body, deferred)


def _targets(name: str, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """The shardloader modules an import statement executes (the named module, or for
    ``from package import module`` that submodule)."""
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names if a.name in MODULES)
        return
    base = node.module or ""
    if node.level:
        package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    if base.split(".")[0] != "shardloader":
        return
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        yield sub if sub in MODULES else base


def import_graph(deferred: bool = False) -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        graph[name] = {t for node in _imports(tree.body, deferred) for t in _targets(name, node)}
        graph[name].discard(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def _unexpected(found: list[set[str]], known: list[set[str]]) -> list[list[str]]:
    return [sorted(c) for c in found if not any(c <= k for k in known)]


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert circles(graph) == [{"a", "b", "c"}]


def test_the_graph_sees_module_level_and_deferred_imports():
    graph, full = import_graph(), import_graph(deferred=True)
    assert "shardloader.batching.base" in graph["shardloader.batching.padded"]
    assert "shardloader.vision.collate" in graph["shardloader.vision"]  # from package import
    assert "shardloader.storage.store" not in graph["shardloader.options"]  # only in a method
    assert "shardloader.storage.store" in full["shardloader.options"]
    lazy = {"shardloader.errors", "shardloader._lazy"}  # every other public name loads on use
    assert graph["shardloader"] == full["shardloader"] == lazy


def test_package_faces_only_name_what_they_export():
    """A subpackage's ``__init__`` imports its own modules (or the one lazy helper), never the
    package root: a face names what it exports and holds no logic of its own."""
    graph = import_graph(deferred=True)
    for name, path in MODULES.items():
        if path.name != "__init__.py" or name == "shardloader":
            continue
        assert "shardloader" not in graph[name], f"{name} imports the package root"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defs = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        if name != "shardloader.pack":  # its lazy table predates this rule (owned elsewhere)
            assert defs == [], f"{name} defines {defs}"


def test_no_import_circles():
    """Module-level imports form no circle (issue 12 item 5), bar the known ones above."""
    assert _unexpected(circles(import_graph()), KNOWN_CIRCLES) == []


def test_no_circles_through_deferred_imports_either():
    """An import inside a function does not make a circle go away (batching <-> collate was
    one: collate imported batching at the top, batching imported collate in its methods)."""
    assert _unexpected(circles(import_graph(deferred=True)), KNOWN_DEFERRED_CIRCLES) == []


# ShardedDataset's own modules: the class, and the position state it inherits
DATASET_MODULES = {"dataset.py": "ShardedDataset", "deliver/position.py": "DatasetPosition"}


def _private_names_of_sharded_dataset() -> set[str]:
    names = set()
    for module, name in DATASET_MODULES.items():
        tree = ast.parse((PACKAGE / module).read_text(encoding="utf-8"))
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
        names |= _private_names_of(cls)
    return names


def _private_names_of(cls: ast.ClassDef) -> set[str]:
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and (node.value.id == "self")
        ):
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_sharded_dataset_state_is_reached_through_public_methods():
    """No module but the dataset's own (dataset.py, deliver/position.py) touches ShardedDataset's
    private attributes (``ds._control`` was read and written by the loader)."""
    private = _private_names_of_sharded_dataset()
    assert {"_control", "_plan", "_lengths"} <= private
    roots = [PACKAGE, PACKAGE.parent / "tools", PACKAGE.parent / "tests"]
    offenders = []
    for path in (p for root in roots for p in root.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix() if PACKAGE in path.parents else ""
        own = rel in DATASET_MODULES
        if own or path == Path(__file__).resolve():
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in private
                and not (isinstance(node.value, ast.Name) and node.value.id == "self")
            ):
                offenders.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert offenders == []


# Small modules with one job each (issue 12 asked for none over ~400 lines).  A module that
# grows past this gets split along its seams, as format/tar/format.py (writer, reader, format) was.
MAX_MODULE_LINES = 425


def test_no_module_outgrows_the_size_limit():
    sizes = {
        name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in MODULES.items()
    }
    too_big = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert too_big == {}, f"split these modules along their seams: {too_big}"
    assert max(sizes.values()) > MAX_MODULE_LINES // 2  # the walk found the package's modules


# The top level reads like the data flow (DESIGN.md opens with the tree): a few modules that
# everything shares, the dataset itself, and the stages as packages.
TOP_LEVEL = {
    "__init__",
    "__main__",
    "errors",
    "manifest",
    "schema",
    "units",
    "world",
    "dataset",
    "mixture",
    "presets",
    "collate",
    "options",
}
STAGES = {"plan", "read", "deliver", "format", "storage", "pack", "batching", "codecs", "vision"}


def test_the_top_level_is_a_few_modules_beside_the_stages():
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "_lazy"}
    assert modules == TOP_LEVEL, f"new top-level modules belong in a stage package: {modules}"
    assert len(modules - {"__init__", "__main__"}) <= 10
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert STAGES <= packages, STAGES - packages


def test_each_format_has_a_folder_of_its_own():
    for name in ("tar", "arrow", "tokens"):
        folder = PACKAGE / "format" / name
        assert {p.stem for p in folder.glob("*.py")} >= {"__init__", "format"}, name
    loose = {p.stem for p in (PACKAGE / "format").glob("*.py")}
    assert not loose & {"tar", "arrow", "tokens"} and not any(n.startswith("tar") for n in loose)


def test_every_module_says_what_lives_there():
    missing = [
        name
        for name, path in MODULES.items()
        if not ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert missing == []


def _subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (PACKAGE / parts[-1]).is_dir() else None


def test_plan_and_options_stay_below_the_read_path():
    """The plan is pure (no read path, no torch, deferred imports included) and the option
    objects a user builds import nothing of the read path, so ``help(ReadOptions)`` and the
    plan stay clear of the pass machinery."""
    full = import_graph(deferred=True)
    for name, targets in full.items():
        if name.startswith(("shardloader.plan.", "shardloader.options")):
            reads = sorted(
                t for t in targets if t.startswith(("shardloader.read", "shardloader.deliver"))
            )
            assert reads == [], f"{name} imports {reads}"
    for path in (PACKAGE / "plan").glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {
            alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        } | {
            (node.module or "").split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
        }
        assert "torch" not in imported, f"{path.name} imports torch"


def test_at_most_one_two_way_import_between_subpackages():
    full = import_graph(deferred=True)
    edges = {
        (a, b)
        for name, targets in full.items()
        for t in targets
        if (a := _subpackage(name)) and (b := _subpackage(t)) and a != b
    }
    both = sorted({tuple(sorted(e)) for e in edges if e[::-1] in edges})
    assert len(both) <= 1, both
