"""The public surface is what __all__ says, and each error is also the matching built-in.

``import shardloader`` resolves names lazily (NOTE [lazy public names] in shardloader/__init__.py):
the table, ``__all__`` and the ``TYPE_CHECKING`` block that mypy and IDEs read must agree.
"""

import ast
import importlib
import inspect
import pkgutil
import subprocess
import sys
import types

import pytest

import shardloader
from shardloader import errors

# The names README and the issues promise at the top level.
PROMISED = {
    "ShardedDataset",
    "make_loader",
    "ShardLoader",
    "monitor",
    "Monitor",
    "MonitorStats",
    "ReadOptions",
    "CacheOptions",
    "RetryPolicy",
    "ShuffleOptions",
    "Decoder",
    "RemoteLoader",
    "read_manifest",
    "Manifest",
    "EpochReport",
    "PadCollate",
    "PackCollate",
    "DetectionCollate",
    "FixedBatches",
    "BucketBatches",
    "TokenBudgetBatches",
    "PackedBatches",
}


def test_all_names_exist_and_public_names_are_exported():
    assert sorted(shardloader.__all__) == sorted(set(shardloader.__all__))
    for name in shardloader.__all__:
        assert hasattr(shardloader, name), name
    public = {
        n
        for n, v in vars(shardloader).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType)
    }
    assert public <= set(shardloader.__all__), public - set(shardloader.__all__)


def test_promised_names_are_at_the_top_level():
    assert PROMISED <= set(shardloader.__all__), PROMISED - set(shardloader.__all__)
    assert shardloader.PadCollate is shardloader.collate.PadCollate
    assert shardloader.PackedBatches is shardloader.batching.PackedBatches
    assert set(errors.__all__) <= set(shardloader.__all__)
    assert shardloader.ObjectNotFoundError is errors.ObjectNotFoundError


def _type_checking_imports() -> dict[str, str]:
    tree = ast.parse(inspect.getsource(shardloader))
    blocks = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
    ]
    assert len(blocks) == 1
    return {
        alias.name: node.module
        for node in blocks[0].body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def test_lazy_table_type_checking_block_and_all_agree():
    table = shardloader._EXPORTS
    assert _type_checking_imports() == table
    assert set(table) | set(errors.__all__) >= set(shardloader.__all__)
    assert set(table) <= set(shardloader.__all__)
    for name, module in table.items():
        value = getattr(shardloader, name)
        assert value.__module__ == module, (name, value.__module__)  # pickles by its home
    assert set(shardloader.__all__) <= set(dir(shardloader))


def test_submodules_are_attributes_and_unknown_names_fail():
    submodules = "batching bench codecs collate deliver errors manifest plan read service storage"
    for name in [*submodules.split(), "vision"]:
        assert name in dir(shardloader), name
        assert isinstance(getattr(shardloader, name), types.ModuleType), name
    with pytest.raises(AttributeError, match="no attribute 'PadColate'"):
        shardloader.PadColate  # noqa: B018


@pytest.mark.subprocess
def test_import_shardloader_does_not_import_torch():
    code = (
        "import sys, shardloader; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy', 'pyarrow'}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]"


def test_every_error_is_a_shardloader_error_and_a_builtin():
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.ShardloaderError)
        if cls is not errors.ShardloaderError:
            assert issubclass(cls, (ValueError, OSError, RuntimeError)), name


# Public modules still without __all__, and public exception classes outside errors.py, in parts
# other helpers of issue 12 are restructuring (format registry and storage handle; commands).
# Anything else fails.
PENDING_ALL: set[str] = set()


def _public_modules() -> list[types.ModuleType]:
    """Every importable module of the package without a private (``_``) part in its name."""
    names = [m.name for m in pkgutil.walk_packages(shardloader.__path__, "shardloader.")]
    public = ["shardloader"] + [
        n for n in names if not any(p.startswith("_") for p in n.split("."))
    ]
    return [importlib.import_module(n) for n in public]


def test_every_public_submodule_declares_all_and_every_name_exists():
    modules = _public_modules()
    assert {
        "shardloader.batching.padded",
        "shardloader.vision.collate",
        "shardloader.plan.epoch",
    } <= {m.__name__ for m in modules}
    missing = sorted(
        m.__name__ for m in modules if not hasattr(m, "__all__") and m.__name__ not in PENDING_ALL
    )
    assert missing == []
    for module in modules:
        names = getattr(module, "__all__", [])
        assert len(names) == len(set(names)), module.__name__
        absent = [n for n in names if not hasattr(module, n)]
        assert absent == [], (module.__name__, absent)


def test_every_public_exception_class_is_in_the_tree():
    """An error a caller can meet is one of errors.py's classes (each also a built-in)."""
    outside = []
    for module in _public_modules():
        for name, value in vars(module).items():
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
                and not name.startswith("_")
            ):
                if module.__name__ != "shardloader.errors":
                    outside.append(f"{module.__name__}.{name}")
    assert sorted(outside) == []
