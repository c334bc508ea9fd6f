"""MkDocs hooks of the documentation site (mkdocs.yml ``hooks:``).

The package's docstrings name other objects with Sphinx roles (``:func:`save```,
``:class:`~.errors.RankFailedError```), which Python's own tools read; the site renders
docstrings as Markdown, where a role would show as raw text before the code span. This hook
drops the role and keeps the name as code, as Sphinx displays it: ``~`` shows the last
component only, leading dots (a relative name) are dropped.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj|const|py:\w+):<code>(~?)\.*([^<]*)</code>")


def _name(match: re.Match[str]) -> str:
    short, name = match.group(1), match.group(2)
    return f"<code>{name.rsplit('.', 1)[-1] if short else name}</code>"


def on_page_content(html: str, **kwargs: Any) -> str:
    """The page's HTML with Sphinx roles before code spans replaced by the code span."""
    return _ROLE.sub(_name, html)
