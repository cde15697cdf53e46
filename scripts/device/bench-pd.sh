#!/usr/bin/env bash
# bench.pd on a GPU machine: P/D vs aggregated behind the router, the 8B shape (random weights).
#
#   bash scripts/device/bench-pd.sh --fetch-wheels     # here, with PyPI: the wheels the GPU image
#                                                      # lacks (verify-engine.sh's list), into .whl/
#   bash scripts/device/bench-pd.sh [bench.pd flags]   # there, repository root as cwd: two GPUs
#   bash scripts/device/bench-pd.sh --share-gpu --quick  # one GPU: a check of the path, not the figure
#
# The carried wheels go to a target folder beside the image's torch (scripts/device/device-env.sh);
# bench.pd's JSON goes to $OUT/bench_pd.json, its progress to $OUT/bench_pd.log, and the engines'
# and router's logs to $OUT/pd-logs/. Exit status: bench.pd's.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
if [ "${1:-}" = "--fetch-wheels" ]; then
  exec bash scripts/device/verify-engine.sh --fetch-wheels
fi
out=${OUT:-$root/bench-pd-out}
mkdir -p "$out"
source "$root/scripts/device/device-env.sh"
# Serving needs what tests/gpu does not: fail here, in one line, rather than in an engine's log.
"$py" -c 'import torch, fastapi, uvicorn, zmq, gguf, httptools; import baton_engine.server.app, baton_engine.router.app
print(f"torch {torch.__version__}, {torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}")' | tee "$out/versions.txt"
work=$(mktemp -d /tmp/bench-pd-XXXXXX)
status=0
PYTHONUNBUFFERED=1 "$py" -m bench.pd --device cuda --json --work-dir "$work" "$@" \
  > "$out/bench_pd.json" 2> "$out/bench_pd.log" || status=$?
mkdir -p "$out/pd-logs"
cp "$work"/*.log "$out/pd-logs/" 2>/dev/null || true
rm -rf "$work"
tail -n 5 "$out/bench_pd.log"
exit "$status"
