.PHONY: test lint setup cluster-build demo demo-down

# Baton end to end on a local control plane; leaves it running (DEMO_NONINTERACTIVE=1 for CI).
demo:
	bash scripts/demo.sh up

demo-down:
	bash scripts/demo.sh down

# Everything on a fresh machine: venv, installs, cached Go builds, lint, type checks, all tests.
test:
	bash scripts/test.sh

setup:
	bash scripts/setup.sh

cluster-build:
	bash devcluster/scripts/build.sh

lint: setup
	.venv/bin/ruff check . && .venv/bin/ruff format --check engine operator devcluster support bench tests && .venv/bin/lint-imports --no-logo
