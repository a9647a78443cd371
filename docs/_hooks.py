"""MkDocs hooks of the documentation site (mkdocs.yml ``hooks``).

The engine's docstrings are written for reading in the source: Sphinx roles such as
``:class:`Task``` mark a name as code. mkdocstrings renders them as Markdown, where the role
would stay as text before the code span; this drops the role and keeps the code span.
"""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:class|mod|func|meth|data|attr|exc|obj|const):(?=<code>)")


def on_page_content(html: str, **_: Any) -> str:
    return ROLE.sub("", html)
