"""Where the documentation lives, for the tests that keep it and the code from drifting apart.

The user documentation is the README (short: what it is, the two commands, a tour) and the
MkDocs site under ``docs/`` (``mkdocs.yml``). ``docs/_incoming/`` holds drafts that are not
part of the site and are not read here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def page(name: str) -> str:
    """The text of one page of the site, by its path under ``docs/``."""
    return (DOCS / name).read_text()


def pages() -> list[Path]:
    """The README and every page of the site, drafts left out."""
    site = sorted(p for p in DOCS.rglob("*.md") if "_incoming" not in p.relative_to(DOCS).parts)
    return [README, *site]


def command_lines(path: Path) -> list[str]:
    """Every command line of a page's bash and console blocks (continuations joined,
    comments and prompts dropped)."""
    lines: list[str] = []
    for lang, body in re.findall(r"```(bash|console|sh)\n(.*?)```", path.read_text(), re.S):
        for raw in body.replace("\\\n", " ").splitlines():
            line = raw.strip()
            if lang == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def table_rows(text: str, header_start: str) -> list[list[str]]:
    """The rows of the Markdown table whose header line starts with ``header_start``, as
    cells (``\\|`` inside a cell kept as ``|``)."""
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[head + 2 :]:
        if not line.startswith("|"):
            break
        cells = re.split(r"(?<!\\) \| ", line.strip().strip("|").strip())
        rows.append([c.strip().replace("\\|", "|") for c in cells])
    return rows
