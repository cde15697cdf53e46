#!/usr/bin/env bash
# Smoke-check an installed image: its console script answers --help, and its imports hold
# (operator/router: no torch; engine: torch imports and is the version the base image shipped).
# Usage: verify-image.sh --role operator|router|engine [--python PY] [--bin-dir DIR]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib.sh"
role="" python=python3 bin_dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --role) role=${2:?--role needs a value}; shift ;;
    --python) python=${2:?--python needs a value}; shift ;;
    --bin-dir) bin_dir=${2:?--bin-dir needs a value}; shift ;;
    *) die "unknown argument: $1" ;;
  esac
  shift
done
case "$role" in
  operator) module=baton_operator.cli; script=baton-operator ;;
  router) module=baton_engine.contract; script=baton-router ;;
  engine) module=baton_engine.contract; script=baton-engine ;;
  *) die "--role must be operator, router or engine, got '$role'" ;;
esac
"$python" -c "import $module" || die "$module does not import"
if [ "$role" = engine ]; then
  "$python" -c 'import torch; print("torch", torch.__version__)' || die "torch does not import"
else
  bash "$here/verify-no-torch.sh" --python "$python"
fi
exe=${bin_dir:+$bin_dir/}$script
command -v "$exe" >/dev/null 2>&1 || die "console script $script not found"
if [ "$role" = operator ]; then
  "$exe" --help >/dev/null || die "$script --help failed"
fi
echo "ok: $role image"
