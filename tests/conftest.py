"""Shared pytest configuration: the local Kubernetes control plane's fixtures, and where Triton's
kernels run: for real on a machine with a GPU, through Triton's interpreter on the CPU otherwise."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch

# An NVIDIA or AMD GPU's device node: the one test of whether Triton's kernels run for real.
GPU_PRESENT = os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")

# Triton reads TRITON_INTERPRET once, when it is first imported, and any test module may import
# it (through the engine's GPU path), so it must be set before collection starts.
if not GPU_PRESENT:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["baton_dev.pytest_plugin"]


@pytest.fixture(scope="session")
def kernel_device() -> torch.device:
    """Where tests put the tensors that Triton kernels read: the GPU (kernels compiled) when there
    is one, else the CPU (kernels interpreted). Tests draw their data from CPU generators and move
    it here, so the same seeds give the same inputs on both."""
    import torch

    if not GPU_PRESENT:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.fail(
            "a GPU device node (/dev/nvidiactl or /dev/kfd) is present, so Triton's kernels are "
            "compiled for it, but this torch build sees no GPU (torch.cuda.is_available() is False)"
        )
    return torch.device("cuda")  # ROCm builds of torch name their GPUs "cuda" too
