"""Names that load on first use (PEP 562): the one place the package's faces get their
``__getattr__`` from, so ``import shardloader`` stays light (NOTE [lazy public names] in
:mod:`shardloader`) and every documented dotted path (``shardloader.read.verify``) still works
after a bare ``import shardloader``."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["on_demand"]


def on_demand(
    package: str, namespace: dict[str, Any], exports: Mapping[str, str] | None = None
) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: a name of ``exports`` (name -> the module that
    defines it) or a submodule is imported when first asked for, then kept in ``namespace``
    (the package's globals) so later lookups skip this function."""
    table = dict(exports or {})

    def getattr_(name: str) -> Any:
        module = table.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
        elif _is_submodule(package, name):
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    return getattr_


def _is_submodule(package: str, name: str) -> bool:
    """Whether ``package.name`` is a module of ours (found, not imported)."""
    if not name.isidentifier() or name.startswith("__"):
        return False
    try:
        return importlib.util.find_spec(f"{package}.{name}") is not None
    except (ImportError, ValueError):
        return False
