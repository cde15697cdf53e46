"""The README's shell code blocks, as the commands a reader would type."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"

_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def shell_blocks(text: str | None = None) -> list[list[str]]:
    """Each ```sh block's commands: comments and blank lines dropped, continuations joined."""
    text = README.read_text() if text is None else text
    blocks = []
    for lang, body in _BLOCK.findall(text):
        if lang not in ("sh", "bash", "shell", "console"):
            continue
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
        blocks.append(commands)
    return blocks


def block_after(heading: str, index: int = 0) -> list[str]:
    """The commands of the `index`-th shell block under the given Markdown heading."""
    text = README.read_text()
    start = text.index(f"\n{heading}\n")
    nxt = re.search(r"^## ", text[start + len(heading) + 2 :], re.M)
    section = text[start : start + len(heading) + 2 + nxt.start()] if nxt else text[start:]
    return shell_blocks(section)[index]
