"""Model sources: `builtin:NAME` (inside the engine image), `pvc://CLAIM/PATH`, `hf:ORG/NAME`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

BUILTIN = r"builtin:[a-z0-9][a-z0-9._-]*"
#: The claim name is a DNS subdomain (dot-separated lowercase labels).
CLAIM = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
MAX_CLAIM = 253
PVC = rf"pvc://{CLAIM}(/[A-Za-z0-9._-]+)*/?"
HF = r"hf:[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*"
SOURCE_PATTERN = rf"^({BUILTIN}|{PVC}|{HF})$"
#: `..` segments would let a pvc:// path leave the mount.
PARENT_SEGMENT = r"(^|/)[.][.](/|$)"


@dataclass(frozen=True)
class ModelSource:
    """A parsed `spec.model.source`."""

    kind: Literal["builtin", "pvc", "hf"]
    ref: str  # builtin: the whole reference; pvc: the claim name; hf: org/name
    path: str = ""  # pvc: the path inside the claim, without a leading slash


def parse_source(source: str) -> ModelSource:
    """Parse a source the CRD schema already accepted; anything else is a clear ValueError."""
    if not re.fullmatch(SOURCE_PATTERN, source) or re.search(PARENT_SEGMENT, source):
        raise ValueError(
            f"spec.model.source: {source!r} is not builtin:NAME, pvc://CLAIM/PATH or hf:ORG/NAME"
        )
    if source.startswith("builtin:"):
        return ModelSource("builtin", source)
    if source.startswith("hf:"):
        return ModelSource("hf", source.removeprefix("hf:"))
    claim, _, path = source.removeprefix("pvc://").partition("/")
    if len(claim) > MAX_CLAIM:
        raise ValueError(
            f"spec.model.source: the claim name of {source!r} is longer than {MAX_CLAIM} characters"
        )
    return ModelSource("pvc", claim, path.strip("/"))
