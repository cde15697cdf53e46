"""Triton kernels run on the CPU through Triton's interpreter (must be set before triton loads)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
