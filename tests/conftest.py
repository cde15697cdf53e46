"""Shared pytest configuration: the local Kubernetes control plane's fixtures, and Triton's
interpreter on machines without a GPU."""

import os

# Triton reads TRITON_INTERPRET once, when it is first imported, and any test module may import
# it (through the engine's GPU path), so it must be set before collection starts. On a machine
# with an NVIDIA or AMD GPU the kernels run for real.
if not (os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")):
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["baton_dev.pytest_plugin"]
