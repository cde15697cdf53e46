"""Kubernetes Events as the operator's pure code reports them; the Kopf handlers post them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


#: Called with each Event the moment what it reports has happened, so that work that fails later
#: still reports it (and a retry, which finds it done, does not report it again).
EventSink = Callable[[Event], None]

#: Posts an Event about the resource whose body is given (the operator: through Kopf).
Poster = Callable[[Mapping[str, Any], Event], None]
