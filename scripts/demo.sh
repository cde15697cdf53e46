#!/usr/bin/env bash
# `make demo` / `make demo-down`: Baton on the local control plane (see devcluster/baton_dev/demo.py).
# Usage: scripts/demo.sh [up [--ci] | down]. DEMO_NONINTERACTIVE=1 is the same as --ci.
set -euo pipefail
cd "$(dirname "$0")/.."
command="${1:-up}"
shift || true

step() {  # step "what" command...: one timed line per shell step, output in a log file
    local what="$1" log="$2"; shift 2
    local began=$SECONDS
    echo "[setup] $what  (log: $log)"
    if ! "$@" >"$log" 2>&1; then
        echo "      FAILED after $((SECONDS - began)) s; last lines of $log:"
        tail -n 20 "$log" | sed 's/^/      /'
        exit 1
    fi
    echo "      done in $((SECONDS - began)) s"
}

if [[ "$command" == "down" ]]; then
    exec .venv/bin/python -m baton_dev.demo down
fi
logs="${BATON_DEV_HOME:-$HOME/.cache/baton/clusters}/demo-setup-logs"
mkdir -p "$logs"
step "Python environment (.venv: engine, router, operator)" "$logs/setup.log" bash scripts/setup.sh
step "Kubernetes binaries (built once from Go modules, cached)" "$logs/cluster-build.log" \
    bash devcluster/scripts/build.sh
exec .venv/bin/python -m baton_dev.demo "$command" "$@"
