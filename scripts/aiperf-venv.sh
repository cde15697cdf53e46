#!/usr/bin/env bash
# The load generator of bench/serving.py: NVIDIA's aiperf from PyPI, in a venv of its own outside
# the repository (its pins, e.g. pyzmq~=26.4 and pandas~=2.3, clash with Baton's). Default
# ~/.cache/baton/aiperf-venv (BATON_AIPERF_VENV overrides). Idempotent: a second run with this
# script unchanged returns at once. Prints the venv's path on its last line.
set -euo pipefail
. "$(dirname "$0")/lib/cached-venv.sh"
AIPERF_VERSION=0.13.0
cached_venv_open aiperf-venv "${BATON_AIPERF_VENV:-$cache/aiperf-venv}" bin/aiperf
echo "aiperf-venv: installing aiperf==$AIPERF_VERSION (uv cache: $UV_CACHE_DIR)" >&2
"${venv_uv[@]}" "aiperf==$AIPERF_VERSION"
"$venv_dir/bin/aiperf" --version >&2
cached_venv_close
