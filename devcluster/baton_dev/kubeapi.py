"""A small Kubernetes REST client over httpx (sync for the harness, async for the node agent).
JSON in, JSON out; errors carry the API server's status code and message."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

JsonObject = dict[str, Any]
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str, reason: str = "") -> None:
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class ApiAccess:
    server: str
    ca_file: Path
    token: str

    @staticmethod
    def from_kubeconfig(path: Path) -> ApiAccess:
        """Read a bearer-token kubeconfig as written by baton_dev.kubeconfig."""
        doc = yaml.safe_load(path.read_text())
        context_name = doc["current-context"]
        context = next(c["context"] for c in doc["contexts"] if c["name"] == context_name)
        cluster = next(c["cluster"] for c in doc["clusters"] if c["name"] == context["cluster"])
        user = next(u["user"] for u in doc["users"] if u["name"] == context["user"])
        return ApiAccess(cluster["server"], Path(cluster["certificate-authority"]), user["token"])

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}


def _raise_for(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        body = response.json()
        raise ApiError(response.status_code, str(body.get("message", "")), str(body.get("reason", "")))
    except (json.JSONDecodeError, AttributeError):
        raise ApiError(response.status_code, response.text) from None


class KubeApi:
    """Blocking client."""

    def __init__(self, access: ApiAccess, timeout_s: float = 30.0) -> None:
        self._client = httpx.Client(
            base_url=access.server, verify=access.ssl_context(), headers=access.headers(), timeout=timeout_s
        )

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> KubeApi:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, body: Any = None, **kw: Any) -> JsonObject:
        headers = {}
        content = None
        if body is not None:
            headers["Content-Type"] = kw.pop("content_type", "application/json")
            content = json.dumps(body)
        response = self._client.request(method, path, content=content, headers=headers, **kw)
        _raise_for(response)
        result: JsonObject = response.json() if response.content else {}
        return result

    def get(self, path: str, **params: Any) -> JsonObject:
        return self.request("GET", path, params=params or None)

    def post(self, path: str, body: JsonObject) -> JsonObject:
        return self.request("POST", path, body)

    def patch(self, path: str, body: JsonObject, content_type: str = MERGE_PATCH) -> JsonObject:
        return self.request("PATCH", path, body, content_type=content_type)

    def delete(self, path: str, body: JsonObject | None = None) -> JsonObject:
        return self.request("DELETE", path, body)


class AsyncKubeApi:
    """asyncio client with list+watch that survives expired resource versions."""

    def __init__(self, access: ApiAccess, timeout_s: float = 30.0) -> None:
        self._client = httpx.AsyncClient(
            base_url=access.server, verify=access.ssl_context(), headers=access.headers(), timeout=timeout_s
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def request(self, method: str, path: str, body: Any = None, **kw: Any) -> JsonObject:
        headers = {}
        content = None
        if body is not None:
            headers["Content-Type"] = kw.pop("content_type", "application/json")
            content = json.dumps(body)
        response = await self._client.request(method, path, content=content, headers=headers, **kw)
        _raise_for(response)
        result: JsonObject = response.json() if response.content else {}
        return result

    async def get(self, path: str, **params: Any) -> JsonObject:
        return await self.request("GET", path, params=params or None)

    async def post(self, path: str, body: JsonObject) -> JsonObject:
        return await self.request("POST", path, body)

    async def put(self, path: str, body: JsonObject) -> JsonObject:
        return await self.request("PUT", path, body)

    async def patch(self, path: str, body: JsonObject, content_type: str = MERGE_PATCH) -> JsonObject:
        return await self.request("PATCH", path, body, content_type=content_type)

    async def delete(self, path: str, body: JsonObject | None = None) -> JsonObject:
        return await self.request("DELETE", path, body)

    async def list_and_watch(
        self, path: str, watch_timeout_s: int = 240, **params: Any
    ) -> AsyncIterator[tuple[str, JsonObject]]:
        """Yield ("SYNC", list) after each (re)list, then watch events ("ADDED", "MODIFIED",
        "DELETED", object). Relists when the resource version expires (410 Gone); reconnects
        from the last seen version when the server ends the watch or the connection drops."""
        while True:
            listing = await self.get(path, **params)
            yield "SYNC", listing
            version: str = listing["metadata"]["resourceVersion"]
            expired = False
            while not expired:
                query = dict(
                    params,
                    watch="1",
                    resourceVersion=version,
                    allowWatchBookmarks="true",
                    timeoutSeconds=str(watch_timeout_s),
                )
                try:
                    async with self._client.stream(
                        "GET", path, params=query, timeout=httpx.Timeout(30.0, read=330.0)
                    ) as response:
                        if response.status_code == 410:
                            break
                        if not response.is_success:
                            await response.aread()
                            _raise_for(response)
                        async for line in response.aiter_lines():
                            if not line:
                                continue
                            event = json.loads(line)
                            kind, obj = event["type"], event["object"]
                            if kind == "ERROR":
                                if obj.get("code") == 410:
                                    expired = True
                                    break
                                raise ApiError(int(obj.get("code", 500)), str(obj.get("message", "")))
                            version = obj["metadata"]["resourceVersion"]
                            if kind != "BOOKMARK":
                                yield kind, obj
                except (httpx.TransportError, httpx.DecodingError):
                    await asyncio.sleep(1.0)
