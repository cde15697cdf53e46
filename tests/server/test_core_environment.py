"""The engine's OpenMP threads sleep while they wait unless the user said otherwise: the core
process's environment, and every process that starts an engine (the offline `LLM`)."""

from __future__ import annotations

import os
import subprocess
import sys

from baton_engine.server.engine_client import core_environment


def test_core_waits_passive_by_default_and_keeps_an_explicit_policy() -> None:
    server_env = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "2"}
    assert core_environment(server_env) == {
        "PATH": "/usr/bin",
        "OMP_NUM_THREADS": "2",
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    assert server_env == {"PATH": "/usr/bin", "OMP_NUM_THREADS": "2"}  # the server's own is untouched
    assert core_environment({"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_WAIT_POLICY": "ACTIVE"}


def _policy_seen_by_the_llm_module(policy: str | None) -> str:
    """OMP_WAIT_POLICY in a fresh process once it imported the offline `LLM`, and whether torch
    (which reads the policy once, when it loads OpenMP) was loaded by then."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    code = (
        "import os, sys; from baton_engine.entrypoints.llm import LLM; "
        "print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_an_offline_llm_process_waits_passive_unless_told_otherwise() -> None:
    assert _policy_seen_by_the_llm_module(None) == "PASSIVE False"
    assert _policy_seen_by_the_llm_module("ACTIVE") == "ACTIVE False"
