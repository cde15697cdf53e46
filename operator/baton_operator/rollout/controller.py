"""Carries out a rollout pass (`generations.plan`) against the API server.

Called by the reconcile: `prepare` before the children are built (the pool Deployments' paused
flag and replicas come from it), `act` after they are applied (release, scale and delete the old
generation's ReplicaSets; in builtin mode the new generation's replicas, under the autoscaler's
field manager, which owns them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from baton_engine import contract
from baton_operator import models
from baton_operator.autoscaler.tick import FIELD_MANAGER as AUTOSCALER
from baton_operator.builders.common import BuildContext, PoolOverride, child_name
from baton_operator.builders.engine import role_kv_key
from baton_operator.kube import Kube, KubeError

from .generations import ANNOTATION_TARGET, LABEL_RETIRING, POOLS, PoolView, RolloutPlan, plan, pool_view

Guard = Callable[[], None]


def keys_of(ctx: BuildContext) -> dict[str, str]:
    """The KV-compatibility key each pool's pods should have."""
    return {role: role_kv_key(ctx, role) for role in POOLS}


async def observe(
    kube: Kube, ctx: BuildContext, deployments: Mapping[str, Mapping[str, Any] | None]
) -> dict[str, PoolView]:
    """Both pools' generations: their ReplicaSets and pods as the API has them now."""
    owner = ctx.owner
    selector = {contract.LABEL_DEPLOYMENT: owner.name}
    replica_sets = await kube.list("apps/v1", "ReplicaSet", owner.namespace, selector)
    pods = await kube.list("v1", "Pod", owner.namespace, selector)
    return {
        role: pool_view(role, role_kv_key(ctx, role), deployments.get(role), replica_sets, pods, owner.uid)
        for role in POOLS
    }


def targets(ctx: BuildContext, views: Mapping[str, PoolView]) -> dict[str, int]:
    """Each pool's replicas once the rollout is done: the spec's with autoscaling off, else the
    count in force when the key changed (recorded on the released ReplicaSets)."""
    out = {}
    for role, view in views.items():
        if ctx.replicas_owned:
            out[role] = ctx.spec.roles()[role].replicas
            continue
        recorded = [r.target for r in view.retiring if r.target is not None]
        out[role] = max(recorded) if recorded else (view.replicas or 0)
    return out


def pass_plan(ctx: BuildContext, views: Mapping[str, PoolView]) -> RolloutPlan:
    roles = ctx.spec.roles()
    return plan(
        views,
        mode=ctx.spec.autoscaling.mode,
        targets=targets(ctx, views),
        surge={role: roles[role].resources.gpus == 0 for role in views},
    )


def with_overrides(ctx: BuildContext, rollout: RolloutPlan) -> BuildContext:
    """The build context whose pool Deployments carry the pass's paused flag and (autoscaling
    off) replicas."""
    if not rollout.active:
        return ctx
    pools = {
        role: PoolOverride(paused=action.paused, replicas=action.replicas if ctx.replicas_owned else None)
        for role, action in rollout.pools.items()
    }
    return dataclasses.replace(ctx, pools=pools)


def _owner_ref(ctx: BuildContext) -> dict[str, Any]:
    # Not the controller: the Deployment still is until it lets go of the ReplicaSet, and an
    # object has at most one. Any owner reference keeps garbage collection working.
    return {
        "apiVersion": models.API_VERSION,
        "kind": models.KIND,
        "name": ctx.owner.name,
        "uid": ctx.owner.uid,
        "controller": False,
        "blockOwnerDeletion": True,
    }


async def act(
    kube: Kube, ctx: BuildContext, views: Mapping[str, PoolView], rollout: RolloutPlan, guard: Guard
) -> None:
    """Release, scale and delete the old generation's ReplicaSets as `rollout` says; in builtin
    mode also set the new generation's replicas."""
    if not rollout.active:
        return
    namespace = ctx.owner.namespace
    for role, action in rollout.pools.items():
        view = views[role]
        # Paused, the Deployment must be left with no ReplicaSet: one at 0 replicas would be
        # scaled to its replicas once the active one is released.
        for name in action.forget:
            guard()
            await kube.delete_if_present("apps/v1", "ReplicaSet", namespace, name)
        if action.adopt_replicas is not None and action.adopt_replicas != view.replicas:
            # Before the generation is given back: the paused Deployment scales its active
            # ReplicaSet to its replicas.
            guard()
            await _set_replicas(kube, ctx, role, action.adopt_replicas)
        for rs in action.release:
            # Out of the Deployment's selector, into the retiring generation, owned by the resource.
            await _relabel_replica_set(
                kube,
                ctx,
                rs.name,
                guard,
                labels={contract.LABEL_ROLE: None, LABEL_RETIRING: role},
                annotations={ANNOTATION_TARGET: str(action.target)},
                owned=True,
            )
        for rs in action.adopt:
            # A rollback: back under the Deployment's selector, which adopts it again.
            await _relabel_replica_set(
                kube,
                ctx,
                rs.name,
                guard,
                labels={contract.LABEL_ROLE: role, LABEL_RETIRING: None},
                annotations={ANNOTATION_TARGET: None},
                owned=False,
            )
        for rs in view.retiring:
            wanted = action.retiring_replicas.get(rs.name)
            if wanted is not None and wanted != rs.replicas and rs.name not in action.delete:
                guard()
                await kube.merge_patch(
                    "apps/v1", "ReplicaSet", namespace, rs.name, {"spec": {"replicas": wanted}}
                )
        if (
            ctx.spec.autoscaling.mode == "builtin"
            and not action.release
            and action.replicas is not None
            and action.replicas != view.replicas
        ):
            guard()
            await _set_replicas(kube, ctx, role, action.replicas)
        for name in action.delete:
            guard()
            try:
                await kube.delete_if_present("apps/v1", "ReplicaSet", namespace, name)
            except KubeError as exc:
                if exc.status != 409:
                    raise


async def _relabel_replica_set(
    kube: Kube,
    ctx: BuildContext,
    name: str,
    guard: Guard,
    *,
    labels: Mapping[str, str | None],
    annotations: Mapping[str, str | None],
    owned: bool,
) -> None:
    """Merge `labels` and `annotations` (None deletes) into a ReplicaSet and set its owner
    references: its others, plus the resource's when `owned`. Conditional on the version just
    read; a ReplicaSet already gone is left so."""
    namespace = ctx.owner.namespace
    current = await kube.get("apps/v1", "ReplicaSet", namespace, name)
    if current is None:
        return
    meta = current["metadata"]
    refs = [r for r in meta.get("ownerReferences") or [] if r.get("uid") != ctx.owner.uid]
    guard()
    await kube.merge_patch(
        "apps/v1",
        "ReplicaSet",
        namespace,
        name,
        {
            "metadata": {
                "resourceVersion": meta["resourceVersion"],
                "labels": dict(labels),
                "annotations": dict(annotations),
                "ownerReferences": [*refs, _owner_ref(ctx)] if owned else refs,
            }
        },
    )


async def _set_replicas(kube: Kube, ctx: BuildContext, role: str, replicas: int) -> None:
    """A pool Deployment's replicas, under the field manager that owns them: the autoscaler's
    in builtin mode; with autoscaling off a plain patch (the operator's next apply, forced,
    sets the count it plans)."""
    name, namespace = child_name(ctx.owner, role), ctx.owner.namespace
    if ctx.spec.autoscaling.mode == "builtin":
        manifest = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"replicas": replicas},
        }
        await kube.apply(manifest, field_manager=AUTOSCALER)
    else:
        await kube.merge_patch("apps/v1", "Deployment", namespace, name, {"spec": {"replicas": replicas}})


@dataclass(frozen=True)
class Pass:
    """One reconcile's view of the rollout: the generations seen, the plan, and the build
    context carrying the plan's overrides."""

    views: Mapping[str, PoolView]
    plan: RolloutPlan
    context: BuildContext

    @property
    def finished(self) -> bool:
        """This pass deletes the old generation's last ReplicaSets: the rollout is complete."""
        return any(action.delete for action in self.plan.pools.values())

    @property
    def keys(self) -> dict[str, str]:
        return {role: view.key for role, view in self.views.items()}


async def begin(
    kube: Kube, ctx: BuildContext, deployments: Mapping[str, Mapping[str, Any] | None], guard: Guard
) -> Pass:
    """Observe and plan before the children are applied. A stepping pass acts at once (in
    builtin mode the new generation's replicas must be set before its Deployment is unpaused);
    a switch acts after the paused Deployments are applied (`switch`)."""
    views = await observe(kube, ctx, deployments)
    rollout = pass_plan(ctx, views)
    if rollout.active and not rollout.switching:
        await act(kube, ctx, views, rollout, guard)
    return Pass(views, rollout, with_overrides(ctx, rollout))


async def switch(
    kube: Kube,
    ctx: BuildContext,
    previous: Pass,
    deployments: Mapping[str, Mapping[str, Any] | None],
    guard: Guard,
) -> Pass:
    """The pools' Deployments hold the new template, paused: release their old ReplicaSets,
    then plan (and act on) the first step; its context unpauses them."""
    await act(kube, ctx, previous.views, previous.plan, guard)
    return await begin(kube, ctx, deployments, guard)
