#!/usr/bin/env bash
# The project's one test command (README: `make test`). On a fresh machine it does all set-up:
# the venv and its installs (cached), the local Kubernetes binaries (cached Go builds), then lint,
# type checks and the whole test suite. Extra arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
bash devcluster/scripts/build.sh
export PATH="$root/.venv/bin:$PATH"
echo "== ruff"
ruff check .
ruff format --check engine operator devcluster support bench tests
echo "== import-linter (layers, torch-free boundary)"
lint-imports --no-logo
echo "== mypy (operator, devcluster, engine, support)"
mypy
echo "== docs (mkdocs build --strict: a broken link or a page missing from the nav fails)"
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet
echo "== pytest"
python -m pytest "$@"
