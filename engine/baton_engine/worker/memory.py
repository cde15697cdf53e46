"""What a rank process holds in memory (Linux ``/proc/self/status``; device peaks from torch)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

_FIELDS = {
    "VmHWM": "peak_rss_bytes",
    "VmRSS": "rss_bytes",
    "RssAnon": "private_bytes",
    "RssFile": "file_bytes",
}


def process_memory(device: torch.device | None = None) -> dict[str, int]:
    """peak_rss_bytes (high-water mark of resident memory), rss_bytes, private_bytes (anonymous:
    what the process owns, the weights it copied in included), file_bytes (mapped file pages,
    e.g. a checkpoint read through mmap; shared and reclaimable); on a GPU also
    device_peak_bytes / device_bytes (torch's allocator). Empty where /proc is missing."""
    memory: dict[str, int] = {}
    status = Path("/proc/self/status")
    if status.exists():
        text = status.read_text()
        for field, name in _FIELDS.items():
            match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
            if match:
                memory[name] = int(match.group(1)) * 1024
    if device is not None and device.type == "cuda":
        memory["device_peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
        memory["device_bytes"] = int(torch.cuda.memory_allocated(device))
    return memory
