#!/usr/bin/env bash
# Fail if torch (or triton/transformers) is installed: the operator and router images must not
# carry it. Usage: verify-no-torch.sh [--python PY]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib.sh"
python=python3
while [ $# -gt 0 ]; do
  case "$1" in
    --python) python=${2:?--python needs a value}; shift ;;
    *) die "unknown argument: $1" ;;
  esac
  shift
done
"$python" - <<'PY'
import importlib.util
import sys

found = [name for name in ("torch", "triton", "transformers") if importlib.util.find_spec(name) is not None]
if found:
    sys.exit(f"error: torch-free image contains {', '.join(found)}")
print("ok: no torch, triton or transformers")
PY
