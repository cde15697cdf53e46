"""Every version of a collection's objects, in the order the API server had them, recorded by a
watch on its own thread: what a rollout did between two moments a test looked, never sampled.

A watch delivers each change in order, so the states replayed from it (`states()`) are exactly
the states the API server went through, however slowly this thread ran. With the rollout checks
built on it (`rollout_invariants`) and the rollout tests' keys and end state (`rollout_settled`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from baton_dev.kubeapi import ApiAccess, AsyncKubeApi
from baton_dev.testing import DevCluster, condition, is_ready
from baton_engine import contract
from baton_operator import models
from baton_operator.models import InferenceDeploymentSpec
from baton_operator.rollout.generations import LABEL_RETIRING
from baton_operator.rollout.kv_key import kv_compat_key

Event = tuple[str, dict[str, Any]]  # (ADDED | MODIFIED | DELETED, object)


class Timeline:
    """Records `path` (a collection, e.g. one namespace's pods) from the current state on."""

    def __init__(self, access: ApiAccess, path: str, **params: str) -> None:
        self.access, self.path, self.params = access, path, params
        self.initial: list[dict[str, Any]] = []
        self.events: list[Event] = []
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._task: asyncio.Task[None] | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"timeline {path}", daemon=True)

    def __enter__(self) -> Timeline:
        self._thread.start()
        assert self._started.wait(30), f"the watch of {self.path} did not start"
        if self.error is not None:
            raise self.error
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed already: the watch failed
                self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(timeout=30)
        if self.error is not None and exc[0] is None:
            raise AssertionError(f"the watch of {self.path} failed: {self.error!r}")

    def _run(self) -> None:
        self._task = self._loop.create_task(self._watch())
        try:
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass
        except BaseException as exc:  # reported on exit: a dead watch would miss changes
            self.error = exc
            self._started.set()
        finally:
            self._loop.close()

    async def _watch(self) -> None:
        api = AsyncKubeApi(self.access)
        try:
            async for kind, obj in api.list_and_watch(self.path, **self.params):
                with self._lock:
                    if kind == "SYNC":
                        if self._started.is_set():
                            raise AssertionError(f"the watch of {self.path} had to list again: changes lost")
                        self.initial = list(obj["items"])
                    else:
                        self.events.append((kind, obj))
                self._started.set()
        finally:
            await api.aclose()

    def snapshot(self) -> tuple[list[dict[str, Any]], list[Event]]:
        with self._lock:
            return list(self.initial), list(self.events)

    def states(self) -> Iterator[dict[str, dict[str, Any]]]:
        """The collection (name -> object) as it was after each recorded change."""
        initial, events = self.snapshot()
        current = {o["metadata"]["name"]: o for o in initial}
        for kind, obj in events:
            name = obj["metadata"]["name"]
            if kind == "DELETED":
                current.pop(name, None)
            else:
                current[name] = obj
            yield dict(current)

    def ever(self) -> list[dict[str, Any]]:
        """Every version of every object seen."""
        initial, events = self.snapshot()
        return initial + [obj for _, obj in events]


def key_of(spec: dict[str, Any]) -> str:
    """The KV-compatibility key of the pods of an InferenceDeployment `spec`."""
    parsed = InferenceDeploymentSpec.model_validate(spec)
    return kv_compat_key(parsed.model, parsed.engine)


def key_of_pod(pod: dict[str, Any]) -> str:
    return str((pod["metadata"].get("labels") or {}).get(contract.LABEL_KV_COMPAT, ""))


def deleting(pod: dict[str, Any]) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))


def role_of(pod: dict[str, Any]) -> str:
    return str((pod["metadata"].get("labels") or {}).get(contract.LABEL_ROLE, ""))


def rollout_invariants(timeline: Timeline, counts: dict[str, int], new_key: str, surge: bool = True) -> int:
    """Check every recorded state of a KV-key rollout to `new_key` of pools of `counts` pods: each
    pool within one pod of its count (with spare capacity: never fewer Ready, at most one more),
    no key with Ready prefill pods but no Ready decode pod, the first new prefill pod created
    once a new decode pod was Ready. Returns how many states there were."""
    first_new_prefill_seen = False
    states = 0
    for state in timeline.states():
        states += 1
        pods = [p for p in state.values() if role_of(p) in counts]
        for role, spec_count in counts.items():
            live = [p for p in pods if role_of(p) == role and not deleting(p)]
            ready = [p for p in live if is_ready(p)]
            high = spec_count + 1 if surge else spec_count
            low = spec_count if surge else spec_count - 1
            assert len(live) <= high, (role, [p["metadata"]["name"] for p in live])
            assert len(ready) >= low, (role, len(ready), [p["metadata"]["name"] for p in live])
        for key in {key_of_pod(p) for p in pods}:
            of_key = [p for p in pods if key_of_pod(p) == key and not deleting(p) and is_ready(p)]
            prefill = [p for p in of_key if role_of(p) == contract.ROLE_PREFILL]
            decode = [p for p in of_key if role_of(p) == contract.ROLE_DECODE]
            # No generation serves prefill pods without a decode pod to hand their KV to.
            assert not prefill or decode, (key, [p["metadata"]["name"] for p in prefill])
        new_prefill = [p for p in pods if role_of(p) == contract.ROLE_PREFILL and key_of_pod(p) == new_key]
        if new_prefill and not first_new_prefill_seen:
            first_new_prefill_seen = True
            ready_new_decode = [
                p
                for p in pods
                if role_of(p) == contract.ROLE_DECODE and key_of_pod(p) == new_key and is_ready(p)
            ]
            assert ready_new_decode, "a new prefill pod was created before a new decode pod was Ready"
    assert first_new_prefill_seen
    return states


def rollout_settled(
    cluster: DevCluster,
    namespace: str,
    name: str,
    key: str,
    counts: Mapping[str, int],
    check: Callable[[dict[str, Any]], bool] | None = None,
) -> bool:
    """InferenceDeployment `name`'s pools each at its count, every pod Ready with `key` (and
    passing `check`) and none being deleted, no old generation's ReplicaSet left, Stable."""
    selector = f"{contract.LABEL_DEPLOYMENT}={name}"
    for role, n in counts.items():
        pods = cluster.pods(namespace, f"{selector},{contract.LABEL_ROLE}={role}")
        if len(pods) != n or not all(
            is_ready(p) and key_of_pod(p) == key and not deleting(p) and (check is None or check(p))
            for p in pods
        ):
            return False
    path = f"/apis/apps/v1/namespaces/{namespace}/replicasets"
    if any(
        LABEL_RETIRING in (rs["metadata"].get("labels") or {})
        for rs in cluster.admin.get(path, labelSelector=selector)["items"]
    ):
        return False
    resource = cluster.admin.get(f"/apis/{models.API_VERSION}/namespaces/{namespace}/{models.PLURAL}/{name}")
    progressing = condition(resource, "Progressing")
    return progressing is not None and progressing["reason"] == "Stable"
