"""`baton-operator run`, except that the process dies (exit 137, like SIGKILL) just before its
K+1-th child write; K comes from $CRASH_AFTER_WRITES. For crash-consistency tests only: the
product has no such hook, the writes are counted by wrapping the client here. The operator
issues several writes at once, so the K writes already issued are let finish first: exactly K
children exist when it dies."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Mapping
from typing import Any

from baton_operator import cli
from baton_operator.kube import Kube

LIMIT = int(os.environ["CRASH_AFTER_WRITES"])
writes = 0
in_flight: set[asyncio.Task[Any]] = set()


def _counting(method: Any) -> Any:
    async def wrapper(self: Kube, manifest: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        global writes
        if writes >= LIMIT:
            if in_flight:
                await asyncio.wait(set(in_flight))
            sys.stderr.write(f"crashing_operator: killed before write {writes + 1}\n")
            sys.stderr.flush()
            os._exit(137)
        writes += 1
        task = asyncio.ensure_future(method(self, manifest, *args, **kwargs))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
        return await task

    return wrapper


Kube.apply = _counting(Kube.apply)  # type: ignore[method-assign]
Kube.create_if_absent = _counting(Kube.create_if_absent)  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
