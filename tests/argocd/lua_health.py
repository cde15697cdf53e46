"""Run the chart's Argo CD health check the way Argo CD does: a Lua 5.1 chunk (Argo CD embeds
gopher-lua, a Lua 5.1) with the resource as the global `obj`, returning a table `{status,
message}`, and only the libraries Argo CD opens (no io, os, debug, package or file loading)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CUSTOMIZATION = REPO / "charts/baton/resource_customizations/baton.dev/InferenceDeployment"
HEALTH_LUA = CUSTOMIZATION / "health.lua"
#: Argo CD's health statuses.
STATUSES = ("Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown")
#: Globals a Lua 5.1 runtime opens that Argo CD's sandbox does not.
UNSAFE_GLOBALS = ("io", "os", "debug", "package", "require", "dofile", "loadfile", "load", "loadstring")


def health(obj: dict[str, Any], script: str | None = None) -> dict[str, str]:
    """The health the script reports for `obj` (a resource as the API server returns it)."""
    from lupa import lua51

    lua = lua51.LuaRuntime(register_eval=False, unpack_returned_tuples=False)
    env = lua.globals()
    for name in UNSAFE_GLOBALS:
        env[name] = None
    env.obj = lua.table_from(obj, recursive=True)
    result = lua.execute(script if script is not None else HEALTH_LUA.read_text())
    answer = {key: result[key] for key in ("status", "message") if result[key] is not None}
    if answer.get("status") not in STATUSES:
        raise ValueError(f"health.lua returned status {answer.get('status')!r}, not one of {STATUSES}")
    return answer
