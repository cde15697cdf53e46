"""`baton-dev cluster up|status|env|down` as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from baton_dev.processes import is_alive
from baton_dev.state import ClusterState

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


def _cli(*args: str, home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "baton_dev.cli", "cluster", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "BATON_DEV_HOME": str(home), **env},
        timeout=180,
    )


def test_up_status_env_down(tmp_path: Path) -> None:
    up = _cli("up", "--name", "cli", "--kwok-nodes", "1", "--process-nodes", "1", home=tmp_path)
    try:
        assert up.returncode == 0, up.stderr
        assert f"kubeconfig (admin):      {tmp_path}/cli/admin.kubeconfig" in up.stdout
        assert f"logs:                    {tmp_path}/cli/logs" in up.stdout

        again = _cli("up", "--name", "cli", home=tmp_path)
        assert again.returncode == 1
        assert "cluster 'cli' is already running" in again.stderr

        status = _cli("status", "--name", "cli", home=tmp_path)
        assert status.returncode == 0
        assert "API /readyz              ok" in status.stdout

        env = _cli("env", "--name", "cli", home=tmp_path).stdout.splitlines()
        assert env[0] == f"export KUBECONFIG={tmp_path}/cli/admin.kubeconfig"
        shell = subprocess.run(
            ["bash", "-c", f"{env[0]}; {env[1]}; kubectl get nodes -o name; helm version --short"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shell.stdout.splitlines()[:2] == ["node/kwok-node-0", "node/process-node-0"]
        assert shell.stdout.splitlines()[2].startswith("v3.21.4")
    finally:
        state = ClusterState.load(tmp_path / "cli")
        down = _cli("down", "--name", "cli", home=tmp_path)
    assert down.returncode == 0
    assert down.stdout.startswith("cluster 'cli' stopped (6 processes: node-agent, kwok,")
    assert [p.name for p in state.processes if is_alive(p)] == []
    after = _cli("status", "--name", "cli", home=tmp_path)
    assert after.returncode == 1
    assert "kube-apiserver           not running" in after.stdout


def test_missing_binaries_are_named(tmp_path: Path) -> None:
    result = _cli("up", home=tmp_path, BATON_K8S_BIN=str(tmp_path / "nothing"))
    assert result.returncode == 1
    assert result.stderr.startswith(f"baton-dev: error: missing in {tmp_path}/nothing: etcd, kube-apiserver,")
    assert "make cluster-build" in result.stderr
