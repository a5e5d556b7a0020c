"""The one registry of input layouts: discovery, ``PackOptions`` and ``--layout`` ask it.

The built-in layouts register here, in this order (the CLI keeps a copy of their names for a
fast ``--help``); a layout from elsewhere registers with :func:`register_layout` before ``pack``
runs (see DESIGN.md, "How to add an input layout").
"""

from __future__ import annotations

from shardloader.errors import UsageError
from shardloader.pack.layouts.base import Layout
from shardloader.pack.layouts.class_folders import ClassFolders
from shardloader.pack.layouts.key_groups import KeyGroups
from shardloader.pack.layouts.records import Records
from shardloader.pack.layouts.tars import Tars

__all__ = [
    "AUTO",
    "BUILTIN_LAYOUTS",
    "register_layout",
    "unregister_layout",
    "get_layout",
    "layout_names",
    "registered_layouts",
]

AUTO = "auto"  # --layout auto: ask every registered layout

_LAYOUTS: dict[str, Layout] = {}


def register_layout(layout: Layout, *, replace: bool = False) -> Layout:
    """Make ``layout`` known to discovery and ``PackOptions(layout=...)``; returns it.

    A second layout under a taken name is a :class:`~shardloader.errors.UsageError` unless
    ``replace`` is true.
    """
    if not isinstance(layout, Layout):
        raise UsageError(f"register_layout needs a Layout instance, got {layout!r}")
    name = getattr(layout, "name", None)
    if not isinstance(name, str) or not name or name == AUTO:
        raise UsageError(f"layout {layout!r}: give it a name (not {AUTO!r})")
    if not isinstance(layout.rank, int):
        raise UsageError(f"layout {name!r}: rank must be an int, got {layout.rank!r}")
    if name in _LAYOUTS and not replace:
        raise UsageError(
            f"a layout named {name!r} is already registered ({_LAYOUTS[name]!r}); pass "
            "replace=True to replace it"
        )
    _LAYOUTS[name] = layout
    return layout


def unregister_layout(name: str) -> None:
    """Forget the layout ``name`` (a plugin that is unloaded, a test that cleans up)."""
    if _LAYOUTS.pop(name, None) is None:
        raise UsageError(f"no layout named {name!r} is registered")


def get_layout(name: str) -> Layout:
    """The registered layout ``name``; a :class:`~shardloader.errors.UsageError` naming the
    known ones otherwise."""
    try:
        return _LAYOUTS[name]
    except KeyError:
        raise UsageError(
            f"unknown layout {name!r}; choose one of {', '.join(layout_names(auto=True))}"
        ) from None


def layout_names(*, auto: bool = False) -> tuple[str, ...]:
    """Registered names in registration order; with ``auto``, ``"auto"`` first."""
    return (AUTO, *_LAYOUTS) if auto else tuple(_LAYOUTS)


def registered_layouts() -> tuple[Layout, ...]:
    """Every registered layout, in registration order."""
    return tuple(_LAYOUTS.values())


for _builtin in (ClassFolders(), KeyGroups(), Records(), Tars()):
    register_layout(_builtin)

BUILTIN_LAYOUTS: tuple[str, ...] = layout_names()  # what the CLI's --layout offers, after auto
