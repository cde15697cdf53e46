"""Paged decode attention on CPU in C (`cpu_paged_decode.c`), built on first use with the host's C
compiler and called through ctypes.

The torch path gathers a decode row's blocks into a contiguous buffer and runs SDPA over it: K and
V cross memory three times (read, write, read again) and SDPA's tiles are sized for prefill. The
C kernel walks the block table and reads each K and V vector once. It is compiled for the CPU it
runs on (``-march=native``), with OpenMP (the process's runtime: torch's libgomp is already
loaded under the same soname), into ``$XDG_CACHE_HOME/baton/kernels`` (``~/.cache`` by default;
a temporary folder when that is not writable), keyed by source, compiler and CPU, written
atomically so that engines starting together share one build. No compiler, or a failed build: a
warning once, and the torch path serves.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_paged_decode.c")
FLAGS = ("-O3", "-march=native", "-std=gnu11", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)

_int64 = ctypes.c_int64
_pointer = ctypes.c_void_p
_SIGNATURE = [
    _pointer, _int64, _pointer, _pointer, _pointer, _int64, _pointer, _pointer, _pointer, _int64,
    _int64, _int64, _int64, _int64, _int64, ctypes.c_float, ctypes.c_int,
]  # fmt: skip


@dataclass(frozen=True)
class PagedDecodeKernel:
    """The built library: one entry point per cache dtype and the shape limits it was built with."""

    library: ctypes.CDLL
    max_group: int
    """Most query heads sharing one KV head."""
    head_dims: frozenset[int]
    """Head sizes it was built for."""
    max_block: int
    """Largest block size, in tokens."""

    def supports(self, dtype: torch.dtype, heads: int, kv_heads: int, dim: int, block_size: int) -> bool:
        return (
            dtype in SUPPORTED_DTYPES
            and heads % kv_heads == 0
            and heads // kv_heads <= self.max_group
            and dim in self.head_dims
            and block_size <= self.max_block
        )

    def __call__(
        self,
        q: torch.Tensor,
        layer_cache: torch.Tensor,
        rows: DecodeRows,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Attention of `rows` (one query token each) into their tokens of `out`.

        q, out: [tokens, heads, dim] with each token's heads x dim contiguous; layer_cache: the
        contiguous [2, num_blocks, block_size, kv_heads, dim] cache, of q's dtype."""
        _, _, block_size, kv_heads, dim = layer_cache.shape
        heads = q.shape[1]
        for tensor in (q, out):
            if tensor.stride(2) != 1 or tensor.stride(1) != dim:
                raise ValueError(f"each token's heads must be contiguous, got strides {tensor.stride()}")
        if not layer_cache.is_contiguous() or q.dtype != layer_cache.dtype or out.dtype != q.dtype:
            raise ValueError("the cache must be contiguous and of the query's dtype")
        entry = (
            self.library.baton_paged_decode_f32
            if q.dtype == torch.float32
            else self.library.baton_paged_decode_bf16
        )
        status = entry(
            q.data_ptr(),
            q.stride(0),
            layer_cache[0].data_ptr(),
            layer_cache[1].data_ptr(),
            rows.block_tables.ctypes.data,
            rows.block_tables.shape[1],
            rows.seq_lens.ctypes.data,
            rows.query_tokens.ctypes.data,
            out.data_ptr(),
            out.stride(0),
            len(rows.seq_lens),
            heads,
            kv_heads,
            dim,
            block_size,
            scale,
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(f"paged decode kernel refused heads={heads} kv_heads={kv_heads} dim={dim}")


@dataclass(frozen=True)
class DecodeRows:
    """One step's single-token decode rows, host arrays the kernel reads directly."""

    block_tables: npt.NDArray[np.int64]
    """[rows, blocks] C-contiguous: each row's cache blocks (entries past its length unread)."""
    seq_lens: npt.NDArray[np.int64]
    """[rows] positions each row attends over, ``[0, seq_len)`` (its new token included)."""
    query_tokens: npt.NDArray[np.int64]
    """[rows] the row's token index in q and out."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "baton" / "kernels"


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def build(compiler: str, root: Path) -> Path:
    """Compile the kernel (or find it built) under `root`; returns the library's path."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), compiler, version, " ".join(FLAGS), _cpu_identity()]).encode()
    ).hexdigest()[:20]
    library = root / f"cpu_paged_decode-{key}.so"
    if library.exists():
        return library
    root.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=root, prefix=library.name, suffix=".partial")
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, "-o", partial, str(SOURCE)], capture_output=True, text=True, check=True
        )
        os.replace(partial, library)  # atomic: a concurrent build of the same key lands the same bytes
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return library


def load(library_path: Path) -> PagedDecodeKernel:
    library = ctypes.CDLL(str(library_path))
    for name in ("baton_paged_decode_f32", "baton_paged_decode_bf16"):
        entry = getattr(library, name)
        entry.restype = ctypes.c_int
        entry.argtypes = _SIGNATURE
    group, dims_mask, block = _int64(), _int64(), _int64()
    library.baton_paged_decode_limits(ctypes.byref(group), ctypes.byref(dims_mask), ctypes.byref(block))
    head_dims = frozenset(16 * bit for bit in range(63) if int(dims_mask.value) >> bit & 1)
    return PagedDecodeKernel(library, int(group.value), head_dims, int(block.value))


@functools.cache
def paged_decode_kernel() -> PagedDecodeKernel | None:
    """The kernel, built once per process (and once per machine thanks to the cache); None, with
    one warning, where it cannot be built."""
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler (cc, or $CC): CPU decode attention uses the torch path")
        return None
    roots = [cache_root(), Path(tempfile.gettempdir()) / f"baton-kernels-{os.getuid()}"]
    for root in roots:
        try:
            return load(build(compiler, root))
        except PermissionError:
            continue
        except (OSError, subprocess.CalledProcessError) as error:
            detail = getattr(error, "stderr", "") or str(error)
            log.warning("building the CPU decode attention kernel failed (torch path serves): %s", detail)
            return None
    log.warning("no writable kernel cache (%s): CPU decode attention uses the torch path", roots)
    return None
