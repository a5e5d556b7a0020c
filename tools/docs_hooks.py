"""MkDocs hooks for the documentation site (``mkdocs.yml`` names this file).

The docstrings use Sphinx roles (``:class:`~shardloader.ShardedDataset```), which Markdown
renders as the role's name followed by code.  This hook shows the code alone, shortened as
Sphinx would (``~a.b.C`` as ``C``), so the API reference reads like the docstrings mean.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:py:)?(?:attr|class|data|exc|func|meth|mod|obj|const):(<code>)(~?)([^<]*)")


def _shorten(match: re.Match[str]) -> str:
    target = match.group(3)
    if match.group(2):  # "~a.b.C" shows "C"
        target = target.rsplit(".", 1)[-1]
    return f"{match.group(1)}{target}"


def on_page_content(html: str, **_: Any) -> str:
    """Drop the role names that docstrings leave before their code spans."""
    return _ROLE.sub(_shorten, html)
