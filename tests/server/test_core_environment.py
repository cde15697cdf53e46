"""The engine core's environment: OpenMP's waiting threads sleep unless the user said otherwise."""

from __future__ import annotations

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
