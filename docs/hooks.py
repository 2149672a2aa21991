"""MkDocs hook (``hooks:`` in mkdocs.yml): docstrings written with Sphinx roles read cleanly.

The package's docstrings name things the way Sphinx does (``:class:`Task```, ``:func:`report```).
mkdocstrings renders the role's text literally, so a page would show ``:class:`` before the
name's code span; this hook drops the role and keeps the code span.
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):(?=<code>)")


def on_page_content(html: str, **kwargs: object) -> str:
    """The page's HTML with every Sphinx role in front of a code span removed."""
    return _ROLE.sub("", html)
