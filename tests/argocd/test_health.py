"""The chart's Argo CD health check (health.lua) in a real Lua 5.1 interpreter: Argo CD's own test
cases (health_test.yaml) over status objects captured from the operator, variations of them the
capture cannot reach cheaply, and, on the local control plane, the same states made afresh."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from baton_dev.testing import DevCluster
from baton_operator import crd
from tests.argocd import states
from tests.argocd.lua_health import CUSTOMIZATION, HEALTH_LUA, health
from tests.operator_tests.kube_helpers import install_crd_in

CASES: list[dict[str, Any]] = yaml.safe_load((CUSTOMIZATION / "health_test.yaml").read_text())["tests"]
EXPECTED = {Path(c["inputPath"]).stem: c["healthStatus"] for c in CASES}


def fixture(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((states.TESTDATA / f"{name}.yaml").read_text())
    return doc


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    (found,) = [c for c in obj["status"]["conditions"] if c["type"] == kind]
    return found


@pytest.mark.parametrize("case", CASES, ids=lambda c: Path(c["inputPath"]).stem)
def test_argo_cd_case(case: dict[str, Any]) -> None:
    obj = yaml.safe_load((CUSTOMIZATION / case["inputPath"]).read_text())
    assert health(obj) == case["healthStatus"]


def test_cases_cover_every_fixture_and_every_status() -> None:
    assert sorted(EXPECTED) == sorted(p.stem for p in states.TESTDATA.glob("*.yaml"))
    assert {c["status"] for c in EXPECTED.values()} == {"Healthy", "Progressing", "Degraded", "Suspended"}


def test_a_new_generation_is_progressing_until_the_operator_applies_it() -> None:
    obj = fixture("healthy")
    obj["metadata"]["generation"] = 3
    assert health(obj) == {
        "status": "Progressing",
        "message": "Waiting for the operator to apply generation 3",
    }
    obj["status"]["observedGeneration"] = 3  # applied, but Ready still judged generation 1
    assert health(obj)["status"] == "Progressing"
    for kind in ("Ready", "Progressing", "Degraded"):
        condition(obj, kind)["observedGeneration"] = 3
    assert health(obj) == {"status": "Healthy", "message": "prefill 1/1, decode 1/1, router 1/1"}


def test_a_fix_pushed_after_a_failure_is_progressing_not_degraded() -> None:
    obj = fixture("degraded")  # the failure was at generation 1; nothing applied since
    obj["metadata"]["generation"] = 2
    assert health(obj) == {
        "status": "Progressing",
        "message": "Waiting for the operator to apply generation 2",
    }


def test_a_failing_deployment_at_the_current_generation_is_degraded() -> None:
    # What a refresh writes when a child Deployment exceeds its progress deadline.
    obj = fixture("healthy")
    condition(obj, "Degraded").update(
        status="True", reason="DeploymentFailing", message="h-decode: progress deadline exceeded"
    )
    assert health(obj) == {"status": "Degraded", "message": "h-decode: progress deadline exceeded"}


def test_suspended_needs_every_engine_pool_at_zero() -> None:
    obj = fixture("aggregated-healthy")
    obj["status"]["pool"]["desiredReplicas"] = 0
    assert health(obj)["status"] == "Suspended"
    obj = fixture("suspended")
    obj["status"]["decode"]["desiredReplicas"] = 1
    assert health(obj) == {"status": "Progressing", "message": "prefill 0/0, decode 0/0, router 1/1"}


def test_the_script_uses_nothing_outside_argo_cds_sandbox() -> None:
    # health() removes io/os/debug/package/load*: a script reaching for them fails there.
    with pytest.raises(Exception, match="attempt to index"):
        health({"metadata": {}}, "return {status = os.getenv('HOME')}")
    source = HEALTH_LUA.read_text()
    for name in ("os.", "io.", "require", "debug."):
        assert name not in source
    assert health(copy.deepcopy(fixture("healthy")))["status"] == "Healthy"


@pytest.mark.k8s
@pytest.mark.slow
async def test_fresh_states_on_the_control_plane_match_the_fixtures(
    dev_cluster: DevCluster, k8s_namespace: str
) -> None:
    """Each state made again by the real operator code and controllers: the script reads the live
    object as its committed fixture says, and the fixture has not drifted from what the operator
    writes today (regenerate with `python -m tests.argocd.states`)."""
    install_crd_in(dev_cluster, crd.crd())
    live = await states.produce(dev_cluster, k8s_namespace)
    assert sorted(live) == sorted(EXPECTED)
    for name, obj in live.items():
        assert health(obj) == EXPECTED[name], name
        assert states.shape(obj) == states.shape(fixture(name)), name


def test_the_documented_install_renders_the_script(tmp_path: Path) -> None:
    """docs/interop.md's command, run with the built kubectl: an argocd-cm whose key is the one
    Argo CD reads for baton.dev/InferenceDeployment, holding the chart's script verbatim."""
    import os
    import shlex
    import subprocess

    from baton_support.apiserver import binary_dir
    from tests.demo.readme import REPO, block_after

    bins = binary_dir()
    if bins is None:
        pytest.skip("kubectl not built yet (bash devcluster/scripts/build.sh)")
    (command,) = block_after("## Argo CD health check", page=REPO / "docs/interop.md")
    argv = shlex.split(command)
    assert argv[0] == "kubectl"
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "none")}
    done = subprocess.run(
        [str(bins / "kubectl"), *argv[1:]], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    rendered = yaml.safe_load(done.stdout)
    assert (rendered["kind"], rendered["metadata"]) == (
        "ConfigMap",
        {"name": "argocd-cm", "namespace": "argocd"},
    )
    assert rendered["data"] == {
        "resource.customizations.health.baton.dev_InferenceDeployment": HEALTH_LUA.read_text()
    }
