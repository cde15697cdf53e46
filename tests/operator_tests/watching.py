"""Watch streams of a test API server recorded by a thread: what changed while a test waited.

A `Watch` starts at a given resourceVersion (so nothing between "before" and the first event is
missed) and records every event until it is closed. A stream that ends early or fails is an
error of the test (`events()` raises), never silently fewer events.
"""

from __future__ import annotations

import json
import ssl
import threading
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import httpx

from baton_support.apiserver import ApiServer

#: Longer than any test holds a watch: the server must not end it first.
WATCH_SECONDS = 600
#: How long a read may wait for the next event before the stream is resumed (and `close` seen).
READ_TIMEOUT_S = 0.5


@dataclass
class Watch:
    """Events (type, object) of one collection path since `resource_version`."""

    server: ApiServer
    path: str
    resource_version: str
    label_selector: str = ""
    field_selector: str = ""
    _events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    _error: BaseException | None = None
    _closing: threading.Event = field(default_factory=threading.Event)
    _client: httpx.Client | None = None
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _started: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Watch:
        self._client = httpx.Client(
            base_url=self.server.url,
            verify=ssl.create_default_context(cafile=str(self.server.ca_file)),
            headers={"Authorization": f"Bearer {self.server.token}"},
            timeout=httpx.Timeout(30.0, read=READ_TIMEOUT_S),
            trust_env=False,
        )
        self._thread = threading.Thread(target=self._run, name=f"watch {self.path}", daemon=True)
        self._thread.start()
        if not self._started.wait(30):
            raise TimeoutError(f"watch of {self.path} did not start within 30 s")
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        # A short read timeout lets the thread notice `close`; after one, the watch resumes from
        # the last event's resourceVersion, so no event is lost or seen twice.
        assert self._client is not None
        version = self.resource_version
        try:
            while not self._closing.is_set():
                params = {"watch": "1", "resourceVersion": version, "timeoutSeconds": str(WATCH_SECONDS)}
                if self.label_selector:
                    params["labelSelector"] = self.label_selector
                if self.field_selector:
                    params["fieldSelector"] = self.field_selector
                try:
                    with self._client.stream("GET", self.path, params=params) as response:
                        if response.status_code != 200:
                            response.read()
                            raise RuntimeError(
                                f"watch {self.path}: HTTP {response.status_code} {response.text}"
                            )
                        self._started.set()
                        for line in response.iter_lines():
                            if not line:
                                continue
                            event = json.loads(line)
                            if event["type"] == "ERROR":
                                raise RuntimeError(f"watch {self.path}: {event['object']}")
                            version = event["object"]["metadata"]["resourceVersion"]
                            with self._lock:
                                self._events.append((event["type"], event["object"]))
                except httpx.ReadTimeout:
                    continue
                if not self._closing.is_set():
                    raise RuntimeError(f"watch {self.path} ended before the test closed it")
        except BaseException as exc:
            self._error = exc
        finally:
            self._started.set()

    def events(self) -> list[tuple[str, dict[str, Any]]]:
        """Every event so far, oldest first; raises if the stream failed."""
        if self._error is not None:
            raise AssertionError(f"watch of {self.path} failed: {self._error!r}")
        with self._lock:
            return list(self._events)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._client is not None:
            self._client.close()


def resource_version(server: ApiServer, path: str) -> str:
    """The collection's current resourceVersion (a list with limit=1)."""
    with httpx.Client(
        base_url=server.url,
        verify=ssl.create_default_context(cafile=str(server.ca_file)),
        headers={"Authorization": f"Bearer {server.token}"},
        timeout=30.0,
        trust_env=False,
    ) as client:
        response = client.get(path, params={"limit": "1"})
        response.raise_for_status()
        return str(response.json()["metadata"]["resourceVersion"])
