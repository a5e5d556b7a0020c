"""Input layouts for ``pack``: one module per layout, one registry (see :mod:`.registry`).

The face a layout module imports from: the contract (:class:`Layout`, its answers), the values a
layout yields (:class:`SampleRef` of bytes or :class:`InputFile`) and the registry.
"""

from shardloader.pack.layouts.base import (
    FITS,
    NO_FIT,
    Description,
    Inputs,
    Layout,
    OnSkip,
    Source,
    Verdict,
    mixed,
    text_rule,
)
from shardloader.pack.layouts.registry import (
    get_layout,
    layout_names,
    register_layout,
    registered_layouts,
    unregister_layout,
)
from shardloader.pack.refs import InputFile, SampleRef, TextRule

__all__ = [
    "FITS",
    "NO_FIT",
    "Description",
    "InputFile",
    "Inputs",
    "Layout",
    "OnSkip",
    "SampleRef",
    "Source",
    "TextRule",
    "Verdict",
    "get_layout",
    "layout_names",
    "mixed",
    "register_layout",
    "registered_layouts",
    "text_rule",
    "unregister_layout",
]
