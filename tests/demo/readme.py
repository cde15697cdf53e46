"""The shell code blocks of the README and the docs pages, as the commands a reader would type,
and the marker above each block naming the test that runs it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
SHELLS = ("sh", "bash", "shell", "console")

_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_MARKED = re.compile(r"^<!-- tested: ([^>]*) -->\n```(\w*)\n(.*?)^```", re.S | re.M)


def _commands(body: str) -> list[str]:
    commands, pending = [], ""
    for raw in body.splitlines():
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        commands.append(pending + line)
        pending = ""
    return commands


def shell_blocks(text: str | None = None) -> list[list[str]]:
    """Each ```sh block's commands: comments and blank lines dropped, continuations joined."""
    text = README.read_text() if text is None else text
    return [_commands(body) for lang, body in _BLOCK.findall(text) if lang in SHELLS]


@dataclass(frozen=True)
class MarkedBlock:
    tests: tuple[str, ...]
    """Test ids (``path::function``) from the ``<!-- tested: ... -->`` line above the block."""
    commands: list[str]


def marked_blocks(text: str) -> list[MarkedBlock]:
    """The shell blocks that carry a ``<!-- tested: ID, ID -->`` line right above them."""
    return [
        MarkedBlock(tuple(t.strip() for t in ids.split(",")), _commands(body))
        for ids, lang, body in _MARKED.findall(text)
        if lang in SHELLS
    ]


def block_after(heading: str, index: int = 0, page: Path = README) -> list[str]:
    """The commands of the `index`-th shell block under the given Markdown heading of `page`."""
    text = page.read_text()
    start = text.index(f"\n{heading}\n")
    nxt = re.search(r"^## ", text[start + len(heading) + 2 :], re.M)
    section = text[start : start + len(heading) + 2 + nxt.start()] if nxt else text[start:]
    return shell_blocks(section)[index]
