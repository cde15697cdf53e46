"""Open a GGUF file (the `gguf` package reads it with numpy only: no torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def open_gguf(path: Path) -> Any:
    import gguf

    return gguf.GGUFReader(str(path))
