"""`baton-operator run`, except that the process dies (exit 137, like SIGKILL) just before its
K+1-th child write; K comes from $CRASH_AFTER_WRITES. For crash-consistency tests only: the
product has no such hook, the writes are counted by wrapping the client here."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from baton_operator import cli
from baton_operator.kube import Kube

LIMIT = int(os.environ["CRASH_AFTER_WRITES"])
writes = 0


def _counting(method: Any) -> Any:
    async def wrapper(self: Kube, manifest: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        global writes
        if writes >= LIMIT:
            sys.stderr.write(f"crashing_operator: killed before write {writes + 1}\n")
            sys.stderr.flush()
            os._exit(137)
        writes += 1
        return await method(self, manifest, *args, **kwargs)

    return wrapper


Kube.apply = _counting(Kube.apply)  # type: ignore[method-assign]
Kube.create_if_absent = _counting(Kube.create_if_absent)  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
