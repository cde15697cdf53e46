"""GPU-only tests: run on the device machine, skipped elsewhere."""
