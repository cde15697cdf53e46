"""The two generations of a KV-key change, pure: how ReplicaSets and pods are sorted, and what a
pass does in each phase and autoscaling mode (exact actions)."""

from __future__ import annotations

from typing import Any

from baton_engine import contract
from baton_operator.rollout.generations import (
    ANNOTATION_TARGET,
    LABEL_RETIRING,
    PoolAction,
    PoolView,
    ReplicaSetView,
    plan,
    pool_view,
)

OWNER, DEPLOY = "owner-uid", "deploy-uid"
NEW, OLD = "new-key", "old-key"


def rs(
    name: str, key: str, replicas: int, *, owned: bool = True, role: str = "decode", target: int | None = None
) -> dict[str, Any]:
    labels = {contract.LABEL_KV_COMPAT: key}
    refs: list[dict[str, Any]] = []
    annotations = {}
    if owned:
        labels[contract.LABEL_ROLE] = role
        refs.append({"kind": "Deployment", "uid": DEPLOY, "controller": True})
    else:
        labels[LABEL_RETIRING] = role
        refs.append({"kind": "InferenceDeployment", "uid": OWNER, "controller": False})
        if target is not None:
            annotations[ANNOTATION_TARGET] = str(target)
    return {
        "metadata": {
            "name": name,
            "labels": labels,
            "ownerReferences": refs,
            "annotations": annotations,
            "creationTimestamp": f"2026-12-01T00:00:0{len(name) % 10}Z",
            "resourceVersion": "7",
        },
        "spec": {"replicas": replicas},
    }


def pod(
    name: str, key: str, *, role: str = "decode", ready: bool = True, deleting: bool = False
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "labels": {contract.LABEL_ROLE: role, contract.LABEL_KV_COMPAT: key},
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T00:00:09Z"
    return {"metadata": meta, "status": {"conditions": [{"type": "Ready", "status": str(ready)}]}}


DEPLOYMENT = {"metadata": {"uid": DEPLOY}, "spec": {"replicas": 2}}


def test_pool_view_sorts_replica_sets_and_pods_by_generation() -> None:
    unowned = rs("other", OLD, 1, owned=False)  # released, but not by this resource
    unowned["metadata"]["ownerReferences"] = []
    view = pool_view(
        "decode",
        NEW,
        DEPLOYMENT,
        [
            rs("d-new", NEW, 1),
            rs("d-old", OLD, 2),
            rs("d-hist", OLD, 0),
            rs("d-retiring", OLD, 1, owned=False, target=2),
            rs("p-new", NEW, 1, role="prefill"),  # another pool's
            unowned,
        ],
        [
            pod("n1", NEW),
            pod("n2", NEW, ready=False),
            pod("n3", NEW, deleting=True),
            pod("o1", OLD),
            pod("o2", OLD, deleting=True),
            pod("x1", "", ready=True),  # a pod from before keys
            pod("p1", NEW, role="prefill"),
        ],
        OWNER,
    )
    assert [r.name for r in view.releasable] == ["d-old"]
    assert [r.name for r in view.history] == ["d-hist"]
    assert [(r.name, r.target) for r in view.retiring] == [("d-retiring", 2)]
    assert (view.new_replicas, view.new_pods, view.new_ready) == (1, 2, 1)
    assert (view.old_pods, view.old_ready, view.old_keys) == (3, 2, ("", OLD))
    assert view.rolling and view.replicas == 2


def _view(role: str, **fields: Any) -> PoolView:
    return PoolView(role=role, key=NEW, deployment=DEPLOYMENT, **fields)


def _rsv(name: str, replicas: int, target: int | None = None) -> ReplicaSetView:
    return ReplicaSetView(name=name, key=OLD, replicas=replicas, created=name, target=target)


STEADY = {
    "prefill": _view("prefill", new_replicas=1, new_pods=1, new_ready=1),
    "decode": _view("decode", new_replicas=1, new_pods=1, new_ready=1),
}
SURGE = {"prefill": True, "decode": True}
ONE_ONE = {"prefill": 1, "decode": 1}


def test_no_other_key_is_no_rollout() -> None:
    out = plan(STEADY, mode="off", targets=ONE_ONE, surge=SURGE)
    assert (out.active, out.switching, dict(out.pools)) == (
        False,
        False,
        {"prefill": PoolAction(), "decode": PoolAction()},
    )


def test_the_switch_pauses_forgets_the_history_and_releases() -> None:
    views = {
        "prefill": _view(
            "prefill", releasable=(_rsv("p-old", 1),), history=(_rsv("p-h", 0),), old_pods=1, old_keys=(OLD,)
        ),
        "decode": _view("decode", releasable=(_rsv("d-old", 1),), old_pods=1, old_keys=(OLD,)),
    }
    out = plan(views, mode="builtin", targets=ONE_ONE, surge=SURGE)
    assert out.active and out.switching
    assert out.pools["prefill"] == PoolAction(
        paused=True, replicas=2, release=(_rsv("p-old", 1),), forget=("p-h",), target=1
    )
    assert out.pools["decode"] == PoolAction(
        paused=True, replicas=2, release=(_rsv("d-old", 1),), forget=(), target=1
    )
    assert out.message == f"KV-compatibility key {OLD} -> {NEW}: releasing the old generation"


def test_stepping_applies_the_first_unreached_state() -> None:
    # Released, nothing new yet (1:1): a new decode pod first, the old ones stay.
    views = {
        "prefill": _view(
            "prefill", retiring=(_rsv("p-old", 1, target=1),), old_pods=1, old_ready=1, old_keys=(OLD,)
        ),
        "decode": _view(
            "decode", retiring=(_rsv("d-old", 1, target=1),), old_pods=1, old_ready=1, old_keys=(OLD,)
        ),
    }
    out = plan(views, mode="off", targets=ONE_ONE, surge=SURGE)
    assert not out.switching and out.decision is not None
    assert (out.decision.index, out.decision.total) == (0, 4)
    assert out.pools["decode"] == PoolAction(replicas=1, retiring_replicas={"d-old": 1})
    assert out.pools["prefill"] == PoolAction(replicas=0, retiring_replicas={"p-old": 1})
    assert out.message == (
        f"KV-compatibility key {OLD} -> {NEW}: step 1 of 4; "
        "prefill: 0/0 new Ready, 1 old; decode: 0/0 new Ready, 1 old"
    )


def test_the_last_step_deletes_the_empty_old_generation() -> None:
    views = {
        "prefill": _view(
            "prefill", new_replicas=1, new_pods=1, new_ready=1, retiring=(_rsv("p-old", 0, target=1),)
        ),
        "decode": _view(
            "decode", new_replicas=1, new_pods=1, new_ready=1, retiring=(_rsv("d-old", 0, target=1),)
        ),
    }
    out = plan(views, mode="off", targets=ONE_ONE, surge=SURGE)
    assert out.decision is not None and out.decision.done
    assert out.pools["decode"].delete == ("d-old",) and out.pools["prefill"].delete == ("p-old",)


def test_old_pods_still_draining_keep_the_old_generation() -> None:
    views = {
        "prefill": _view(
            "prefill",
            new_replicas=1,
            new_pods=1,
            new_ready=1,
            retiring=(_rsv("p-old", 0),),
            old_pods=1,
            old_keys=(OLD,),
        ),
        "decode": _view(
            "decode",
            new_replicas=1,
            new_pods=1,
            new_ready=1,
            retiring=(_rsv("d-old", 1),),
            old_pods=1,
            old_keys=(OLD,),
        ),
    }
    out = plan(views, mode="off", targets=ONE_ONE, surge=SURGE)
    assert out.decision is not None and not out.decision.done
    assert out.pools["decode"] == PoolAction(
        replicas=1, retiring_replicas={"d-old": 1}
    )  # prefill's old pod first
    assert out.pools["prefill"].delete == ()


def test_retiring_replicas_go_from_the_oldest_release_first() -> None:
    views = {
        "prefill": _view("prefill", new_replicas=1, new_pods=1, new_ready=1),
        "decode": _view(
            "decode",
            new_replicas=2,
            new_pods=2,
            new_ready=2,
            retiring=(_rsv("a-oldest", 1), _rsv("b-newer", 1)),
            old_pods=2,
            old_keys=(OLD,),
        ),
    }
    out = plan(views, mode="off", targets={"prefill": 1, "decode": 3}, surge=SURGE)
    assert out.pools["decode"].retiring_replicas == {"b-newer": 1, "a-oldest": 0}


def test_external_mode_pauses_prefill_while_decode_has_old_pods() -> None:
    rolling = {
        "prefill": _view("prefill", releasable=(_rsv("p-old", 1),), old_pods=1, old_keys=(OLD,)),
        "decode": _view("decode", new_pods=1, old_pods=1, old_keys=(OLD,)),
    }
    out = plan(rolling, mode="external", targets=ONE_ONE, surge=SURGE)
    assert dict(out.pools) == {"prefill": PoolAction(paused=True), "decode": PoolAction()}
    assert not out.switching  # nothing is released in external mode
    done_decode = {"prefill": rolling["prefill"], "decode": _view("decode", new_pods=1, new_ready=1)}
    assert dict(plan(done_decode, mode="external", targets=ONE_ONE, surge=SURGE).pools) == {
        "prefill": PoolAction(),
        "decode": PoolAction(),
    }


def test_pool_view_rolling_back_adopts_the_released_generation_of_the_key() -> None:
    """The spec's key is that of a released ReplicaSet again: it is to be taken back; once its
    role label is back (not adopted yet) its replicas count as the key's."""
    released = [rs("d-back", NEW, 1, owned=False, target=1), rs("d-from", OLD, 1)]
    view = pool_view("decode", NEW, DEPLOYMENT, released, [pod("n1", NEW), pod("o1", OLD)], OWNER)
    assert ([r.name for r in view.adoptable], [r.name for r in view.releasable], view.retiring) == (
        ["d-back"],
        ["d-from"],
        (),
    )
    assert (view.new_replicas, view.new_pods, view.new_ready, view.rolling) == (0, 1, 1, True)
    taken_back = rs("d-back", NEW, 1)
    taken_back["metadata"]["ownerReferences"] = []
    view = pool_view("decode", NEW, DEPLOYMENT, [taken_back], [pod("n1", NEW)], OWNER)
    assert (view.adoptable, view.new_replicas, view.rolling) == ((), 1, False)


def test_a_rollback_switch_releases_the_newer_generation_and_gives_back_the_older() -> None:
    # Stuck at step 1 of OLD -> NEW, the spec went back to OLD's key (called NEW here, the
    # spec's): decode releases its pending pod's ReplicaSet, both pools take theirs back with
    # their replicas set first; prefill's 0-replica history goes before it (a paused Deployment
    # would scale it up).
    back = ReplicaSetView(name="p-back", key=NEW, replicas=1, created="a", target=1)
    d_back = ReplicaSetView(name="d-back", key=NEW, replicas=1, created="a", target=1)
    views = {
        "prefill": PoolView(
            role="prefill",
            key=NEW,
            deployment={"metadata": {"uid": DEPLOY}, "spec": {"replicas": 0}},
            history=(_rsv("p-from", 0),),
            adoptable=(back,),
            new_pods=1,
            new_ready=1,
        ),
        "decode": PoolView(
            role="decode",
            key=NEW,
            deployment={"metadata": {"uid": DEPLOY}, "spec": {"replicas": 1}},
            releasable=(_rsv("d-from", 1),),
            adoptable=(d_back,),
            new_pods=1,
            new_ready=1,
            old_pods=1,
            old_keys=(OLD,),
        ),
    }
    out = plan(views, mode="off", targets=ONE_ONE, surge=SURGE)
    assert out.active and out.switching
    assert out.pools["prefill"] == PoolAction(
        paused=True, replicas=0, forget=("p-from",), target=1, adopt=(back,), adopt_replicas=1
    )
    assert out.pools["decode"] == PoolAction(
        paused=True,
        replicas=1,
        release=(_rsv("d-from", 1),),
        target=1,
        adopt=(d_back,),
        adopt_replicas=1,
    )
    assert out.message == f"KV-compatibility key {OLD} -> {NEW}: taking back the generation of the key"
