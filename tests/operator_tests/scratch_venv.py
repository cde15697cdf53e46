"""A fresh venv holding only one image's install (install-baton.sh itself, offline from the uv
cache): what the operator or router image would contain, without Docker."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def image_venv(path: Path, role: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """Create `path` and install baton[role] the way images/<role>/Dockerfile does."""
    venv.create(path, with_pip=False)
    python = path / "bin/python"
    installer = f"{sys.executable} -m uv pip install --offline --quiet --python {python}"
    cache = os.environ.get("UV_CACHE_DIR", str(Path.home() / ".cache/baton/uv"))
    dockerfile = (REPO / f"images/{role}/Dockerfile").read_text().splitlines()
    (step,) = [line.removeprefix("RUN ").split() for line in dockerfile if "install-baton.sh" in line]
    args = [a.replace("/src", str(REPO)) for a in step] + ["--python", str(python)]
    done = subprocess.run(
        args,
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PIP_INSTALL": installer, "UV_CACHE_DIR": cache},
    )
    return python, done
