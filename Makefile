.PHONY: test lint setup cluster-build

# Everything on a fresh machine: venv, installs, cached Go builds, lint, type checks, all tests.
test:
	bash scripts/test.sh

setup:
	bash scripts/setup.sh

cluster-build:
	bash devcluster/scripts/build.sh

lint: setup
	.venv/bin/ruff check . && .venv/bin/ruff format --check engine operator devcluster bench tests
