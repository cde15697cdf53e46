#!/usr/bin/env bash
# The load generator of bench/serving.py: NVIDIA's aiperf from PyPI, in a venv of its own outside
# the repository (its pins, e.g. pyzmq~=26.4 and pandas~=2.3, clash with Baton's). Default
# ~/.cache/baton/aiperf-venv (BATON_AIPERF_VENV overrides). Idempotent: a second run with this
# script unchanged returns at once. Prints the venv's path on its last line.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${BATON_CACHE:-$HOME/.cache/baton}
export UV_CACHE_DIR=${UV_CACHE_DIR:-$cache/uv}
venv=${BATON_AIPERF_VENV:-$cache/aiperf-venv}
AIPERF_VERSION=0.13.0
UV_VERSION=0.13.8
py=${PYTHON:-python3}
stamp=$venv/.baton-installed
want=$(sha256sum "$root/scripts/aiperf-venv.sh" | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/aiperf" ]; then
  echo "$venv"
  exit 0
fi
t0=$SECONDS
if [ ! -x "$venv/bin/python" ]; then
  echo "aiperf-venv: creating $venv with $($py --version)" >&2
  "$py" -m venv "$venv"
fi
if ! "$venv/bin/python" -m uv --version 2>/dev/null | grep -q "$UV_VERSION"; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "uv==$UV_VERSION"
fi
echo "aiperf-venv: installing aiperf==$AIPERF_VERSION (uv cache: $UV_CACHE_DIR)" >&2
"$venv/bin/python" -m uv pip install --quiet -p "$venv/bin/python" "aiperf==$AIPERF_VERSION"
"$venv/bin/aiperf" --version >&2
echo "$want" > "$stamp"
echo "aiperf-venv: done in $((SECONDS - t0)) s" >&2
echo "$venv"
