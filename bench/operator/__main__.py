"""`python -m bench.operator --json`: the operator load benchmark (code in bench/operator_load.py).

This folder has no `__init__.py` on purpose, like the repository's top-level `operator/`: a
namespace folder never shadows the standard library's `operator`, a module of that name would.
"""

from bench.operator_load import main

if __name__ == "__main__":
    raise SystemExit(main())
