#!/usr/bin/env bash
# The engine on a GPU machine, in one command: the GPU tests (tests/gpu, tests/gpu_kernels) and the
# GPU benchmark (`python -m bench.gpu --json`), in a fresh virtual environment.
#
#   bash scripts/device/verify-engine.sh --fetch-wheels   # here, with PyPI: the wheels the GPU
#                                                         # image lacks, into .whl/ (git-ignored)
#   bash scripts/device/verify-engine.sh                  # there, repository root as cwd
#
# On the GPU machine nothing can be downloaded: the venv sees the image's torch, Triton and
# transformers (--system-site-packages) and installs the repository and the carried wheels with
# --no-index. Logs and bench.gpu's JSON go to $OUT when it is set (the device tool returns that
# folder), else to ./verify-engine-out. Exit status: non-zero when a test failed or bench.gpu
# did not finish with its JSON line.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"

# Packages the engine's GPU path needs that the GPU image (KINDS.md's list) does not hold.
# llguidance: the scheduler imports the structured-output grammar; jsonschema (and its needs):
# tests/gpu/test_structured_output_gpu.py validates answers against their schema. pyzmq: the GPU FP8 test serves over ZMQ.
# fastapi .. kubernetes-asyncio: `baton-engine serve` and `baton-router` (bench.pd, scripts/device/bench-pd.sh);
# opentelemetry-api: fastapi imports it (its telemetry module) and the image lacks it.
WHEELS=(pydantic pydantic-core annotated-types typing-inspection llguidance
  jsonschema jsonschema-specifications referencing rpds-py attrs pyzmq
  fastapi starlette uvicorn httptools gguf cbor2 kubernetes-asyncio opentelemetry-api)

if [ "${1:-}" = "--fetch-wheels" ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> "$(git rev-parse --git-path info/exclude)"
  mkdir -p .whl
  python=${PYTHON:-.venv/bin/python}
  for name in "${WHEELS[@]}"; do
    version=$("$python" -c "import importlib.metadata as m; print(m.version('$name'))")
    "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl "$name==$version"
  done
  ls -1 .whl
  echo "now call the device tool with carry [\".whl\"] and: bash scripts/device/verify-engine.sh"
  exit 0
fi

out=${OUT:-$root/verify-engine-out}
mkdir -p "$out"
# $py (the image's python3) with the carried wheels and the repository on PYTHONPATH.
source "$root/scripts/device/device-env.sh"
"$py" -c 'import torch; assert torch.cuda.is_available(), "no GPU visible to torch"'
"$py" - <<'PY' | tee "$out/versions.txt"
import platform, torch, triton, transformers, pydantic
print(f"python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}, "
      f"transformers {transformers.__version__}, pydantic {pydantic.VERSION}, gpu {torch.cuda.get_device_name()}")
PY

status=0
# -o addopts: the image has no pytest-asyncio, so pyproject's --strict-config would refuse its ini
# keys; the devcluster plugin (Kubernetes fixtures) is not needed by the GPU tests.
PYTHONUNBUFFERED=1 "$py" -m pytest -o addopts=-ra -p no:baton_dev.pytest_plugin -q tests/gpu tests/gpu_kernels \
  2>&1 | tee "$out/gpu-tests.log" || status=1
# fp8 and moe (issue 17) are not in bench.gpu's default sections: named here with the defaults.
PYTHONUNBUFFERED=1 OUT="$out" "$py" -m bench.gpu --json --sections "${BENCH_GPU_SECTIONS:-copy,matmul,parity,kernels,8b,1b,agree,fp8,moe}" 2>&1 | tee "$out/bench-gpu.log" || status=1
tail -n 1 "$out/bench-gpu.log" | "$py" -c '
import json, sys
result = json.loads(sys.stdin.read())
failed = sorted(k for k in result if k.startswith("error_"))
sys.exit(f"bench.gpu sections failed: {failed}" if failed else 0)' || {
  echo "bench.gpu did not end with a JSON line free of failed sections" >&2
  status=1
}
exit "$status"
