"""Joining a tensor-parallel group: the rank's device, the backend, the rendezvous.

One code path for every device: gloo on CPU, NCCL on CUDA (ROCm builds of torch map the same
backend name to RCCL). Rank 0 (the engine core's process) hosts the rendezvous store on a
loopback port; ranks 1..N-1 are its child processes on the same host.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from baton_engine.model.parallel import TensorParallel

log = logging.getLogger(__name__)

STORE_HOST = "127.0.0.1"
COLLECTIVE_TIMEOUT_S = 120.0
"""How long a collective may wait for a peer. Ranks run the same work in lockstep, so a wait
this long means a rank is gone or stuck (the watchdog normally ends the engine much sooner)."""


class TensorParallelDeviceError(ValueError):
    """The tensor-parallel size does not fit the visible devices."""


def rank_device(device: str, rank: int) -> torch.device:
    """Rank `rank`'s device: ``cuda`` -> ``cuda:<rank>``, ``cuda:k`` -> ``cuda:<k + rank>``, cpu -> cpu."""
    base = torch.device(device)
    if base.type == "cpu":
        return base
    return torch.device(base.type, (base.index or 0) + rank)


def check_devices(device: str, size: int) -> None:
    """Raise `TensorParallelDeviceError` when `size` ranks starting at `device` exceed the visible GPUs."""
    base = torch.device(device)
    if base.type == "cpu" or size == 1:
        return
    first = base.index or 0
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if first + size > visible:
        raise TensorParallelDeviceError(
            f"--tensor-parallel-size {size} needs {size} GPUs from {base.type}:{first}, but {visible} "
            f"{'is' if visible == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)"
        )


def backend_for(device: torch.device) -> str:
    return "gloo" if device.type == "cpu" else "nccl"


def create_store(size: int, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (``store.port``)."""
    return dist.TCPStore(
        STORE_HOST,
        0,
        world_size=size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def connect_store(port: int, size: int, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> dist.TCPStore:
    return dist.TCPStore(
        STORE_HOST, port, world_size=size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


def join_group(
    store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float = COLLECTIVE_TIMEOUT_S
) -> TensorParallel:
    """Join the default process group as `rank` of `size` on `device`; the model's view of it."""
    if device.type != "cpu":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device),
        store=store,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    log.info("tensor-parallel rank %d of %d joined (%s on %s)", rank, size, backend_for(device), device)
    return TensorParallel(rank=rank, size=size, group=None)


def agree_min(value: int, parallel: TensorParallel, device: torch.device) -> int:
    """The smallest `value` over the group's ranks (every rank gets the same answer)."""
    if not parallel.is_parallel:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=parallel.group)
    return int(tensor.item())


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
