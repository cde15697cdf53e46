"""Launch parameters of the engine's Triton kernels, per GPU backend, each with its reason.

Triton's ``num_warps`` counts 32-thread warps on NVIDIA but 64-lane wavefronts on AMD, so a value
tuned on an H200 launches twice the lanes on an MI300X; its ``num_stages`` pipelines loads
through shared memory (NVIDIA) or LDS (AMD), whose size differs per target (64 KiB per CU on
CDNA2/CDNA3, 160 KiB on CDNA4, 228 KiB per SM on sm_90). The NVIDIA table holds the values
measured on the H200 (`bench.gpu_tune`); the AMD tables are derived from the compiled kernels'
registers and LDS (`python -m bench.amd_compile`, docs/amd.md) until an AMD GPU measures them.

The launchers take a `LaunchTable`; `launch_table_for` picks the one of the device they run on.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Launch:
    """How one kernel is launched on one backend, and why."""

    #: Warps per program: 32 threads each on NVIDIA, 64-lane wavefronts on AMD.
    num_warps: int
    #: Software-pipelining depth of the kernel's key loop (loads staged in shared memory / LDS).
    num_stages: int
    #: Why these values: where they were measured, or what the compiled kernel's occupancy says.
    reason: str
    #: Keys per tile of an attention kernel's key loop (None: the kernel has no such loop).
    block_n: int | None = None
    #: Verify attention: the most (token, query head) rows one program holds (None: no cap).
    block_m: int | None = None


@dataclass(frozen=True)
class LaunchTable:
    """The launch parameters of every kernel of the decoder step on one backend."""

    #: The table's name: "cuda", or an AMD architecture ("gfx942") or "rocm" for other AMD GPUs.
    name: str
    #: Decode attention when each program walks a whole row (no split of the key axis).
    decode_unsplit: Launch
    #: Decode attention over one slice of a row's keys (split-K, small batches).
    decode_split: Launch
    #: The reduce that merges split-K partial results (decode and verify).
    split_reduce: Launch
    #: Verify (multi-query) attention without split-K.
    verify_unsplit: Launch
    #: Verify attention with split-K.
    verify_split: Launch
    #: Prefill attention for head dims up to 64.
    prefill_small_head: Launch
    #: Prefill attention for head dims above 64.
    prefill_large_head: Launch
    #: RMSNorm and fused add + RMSNorm (one program per token row).
    rms_norm: Launch
    #: Rotary embedding with the K/V cache write (one program per token).
    rotary: Launch
    #: silu(gate) * up; `block_n` is the columns each program handles.
    silu: Launch
    #: The MoE grouped GEMMs (gate_up with silu * up, and down); their tiles follow the step's
    #: pairs per expert (`triton_moe.moe_tiles`).
    moe: Launch

    def prefill(self, head_dim_pad: int) -> Launch:
        return self.prefill_small_head if head_dim_pad <= 64 else self.prefill_large_head


_H200 = "measured on the H200 (bench.gpu_tune, bf16)"

CUDA = LaunchTable(
    name="cuda",
    decode_unsplit=Launch(2, 2, f"{_H200}: few warps and 2 stages when each program walks a whole row", 64),
    decode_split=Launch(8, 4, f"{_H200}: 8 warps and 4 stages for short split-K slices", 64),
    split_reduce=Launch(4, 3, "Triton's defaults (4 warps, 3 stages): a single pass over S x D partials"),
    verify_unsplit=Launch(
        num_warps=4,
        num_stages=2,
        block_n=64,
        block_m=64,
        reason=f"{_H200}: multi-query tiles without split-K; at most 64 rows per program: 128-row tiles "
        "spill on sm_90 (bench.amd_compile)",
    ),
    verify_split=Launch(
        num_warps=8,
        num_stages=3,
        block_n=64,
        block_m=64,
        reason=f"{_H200}: multi-query tiles with split-K; at most 64 rows per program: 256-row tiles spill "
        "on sm_90",
    ),
    prefill_small_head=Launch(4, 2, f"{_H200}: 64 x 64 tiles fit 2 stages", 64),
    prefill_large_head=Launch(4, 2, f"{_H200}: 32-key tiles keep head dim 128 in registers", 32),
    rms_norm=Launch(4, 3, "Triton's defaults: one row per program, memory-bound"),
    rotary=Launch(4, 3, "Triton's defaults: one token per program, memory-bound"),
    silu=Launch(4, 3, "Triton's defaults with 1024 columns per program, memory-bound", 1024),
    moe=Launch(4, 3, "Triton's defaults for a dot loop; not yet tuned on the H200 (bench.gpu's moe section)"),
)

_ON_CDNA = "on gfx90a, gfx942 and gfx950 (bench.amd_compile)"

#: AMD GPUs (CDNA2-4: MI250X, MI300X/MI325X, MI350X/MI355X), until measured on one. Derived from
#: the NVIDIA entry by one rule, each step checked by compiling for the three targets (bfloat16,
#: float16 and float32, head dims 64 and 128, every verify tile): keep the H200's lanes per
#: program (half its warps: a wavefront is 64 lanes), then drop stages, then add waves, until no
#: launch spills (float32 included) or needs more LDS than a CU has (64 KiB on gfx90a and gfx942).
ROCM = LaunchTable(
    name="rocm",
    decode_unsplit=Launch(
        num_warps=2,
        num_stages=1,
        block_n=64,
        reason="1 wave (the H200's 64 lanes) spills 67 SGPRs at float32 x head dim 128 on gfx942, and 2 "
        "stages need 68 KiB of LDS there; 2 waves, 1 stage: no spill, at most 32 KiB of LDS, 1 to 5 waves "
        f"per SIMD {_ON_CDNA}; twice the waves of 1 at bfloat16 x 128 (16 KiB of LDS per program limits)",
    ),
    decode_split=Launch(
        num_warps=4,
        num_stages=1,
        block_n=64,
        reason="4 waves = the H200's 256 lanes; 2 stages need 68 KiB of LDS at float32 x head dim 128 (its "
        "4 stages at 8 waves: 132 KiB); 1 stage: no spill, at most 32 KiB of LDS, 1 to 6 waves per SIMD "
        f"{_ON_CDNA}",
    ),
    split_reduce=Launch(
        num_warps=4,
        num_stages=2,
        reason=f"Triton's AMD defaults (no loop to pipeline): at most 53 VGPRs, 8 waves per SIMD {_ON_CDNA}",
    ),
    verify_unsplit=Launch(
        num_warps=2,
        num_stages=1,
        block_n=64,
        block_m=64,
        reason="2 waves = the H200's 128 lanes; 2 stages need 68 KiB of LDS at float32 x head dim 128 and "
        "spill there; 1 stage: no spill, at most 32 KiB of LDS, 1 to 5 waves per SIMD "
        f"{_ON_CDNA}; at most 64 rows per program, as on NVIDIA",
    ),
    verify_split=Launch(
        num_warps=4,
        num_stages=1,
        block_n=64,
        block_m=64,
        reason="4 waves = the H200's 256 lanes; 2 stages need 80 KiB of LDS at float32 x head dim 128 on "
        "gfx942; 1 stage: no spill, at most 32 KiB of LDS, 1 to 6 waves per SIMD "
        f"{_ON_CDNA}; at most 64 rows per program",
    ),
    prefill_small_head=Launch(
        num_warps=2,
        num_stages=2,
        block_n=64,
        reason="2 waves = the H200's 128 lanes, with its 2 stages: no spill, at most 32 KiB of LDS on "
        "gfx90a and gfx942 (64 of gfx950's 160 KiB), 1 to 2 waves per SIMD (bench.amd_compile)",
    ),
    prefill_large_head=Launch(
        num_warps=2,
        num_stages=2,
        block_n=32,
        reason="2 waves = the H200's 128 lanes, with its 2 stages: no spill, at most 32 KiB of LDS on "
        "gfx90a and gfx942 (64 of gfx950's 160 KiB), 1 to 2 waves per SIMD (bench.amd_compile)",
    ),
    rms_norm=Launch(
        num_warps=4,
        num_stages=2,
        reason="Triton's AMD defaults (no loop to pipeline): 4 waves spread a small decode batch's rows "
        "over more SIMDs than the H200's 128 lanes (2 waves) would; at most 67 VGPRs, 7 to 8 waves per "
        f"SIMD {_ON_CDNA}",
    ),
    rotary=Launch(
        num_warps=4,
        num_stages=2,
        reason=f"as rms_norm, one token per program: at most 94 VGPRs, 5 to 8 waves per SIMD {_ON_CDNA}",
    ),
    silu=Launch(
        num_warps=4,
        num_stages=2,
        block_n=1024,
        reason="as rms_norm, with the H200's 1024 columns per program: at most 34 VGPRs, 8 waves per SIMD "
        f"{_ON_CDNA}",
    ),
    moe=Launch(
        num_warps=4,
        num_stages=1,
        reason="float32 tiles of 16 to 64 rows with the 64 x 64 gate and up tiles need 72 to 96 KiB of LDS "
        "at the H200's 3 stages (36 to 48 KiB per stage), over the 64 KiB of gfx90a and gfx942: 1 stage, "
        "4 waves (bench.amd_compile)",
    ),
)

#: The A100 (sm_80): the H200's table but for one entry, where its compiled kernel spills.
CUDA_SM80 = dataclasses.replace(
    CUDA,
    name="cuda-sm80",
    verify_unsplit=Launch(
        num_warps=8,
        num_stages=2,
        block_n=64,
        block_m=64,
        reason="the H200's 4 warps spill 8 bytes (255 registers) at 64 rows x head dim 128 on sm_80; 8 "
        "warps, as in the split entry: 128 registers, no spill (bench.amd_compile)",
    ),
)

#: By table name.
LAUNCH_TABLES: dict[str, LaunchTable] = {table.name: table for table in (CUDA, CUDA_SM80, ROCM)}


def table_for_arch(arch: str) -> LaunchTable:
    """The table of a device architecture: "sm_90", "sm_80"... (NVIDIA) or "gfx942"... (AMD)."""
    if arch.startswith("gfx"):
        return ROCM
    return CUDA_SM80 if arch == "sm_80" else CUDA


def arch_from_properties(hip_version: str | None, gcn_arch_name: str, major: int, minor: int) -> str:
    """The architecture name of a GPU from what torch reports about it.

    ROCm builds of torch name AMD GPUs "cuda" too; `torch.version.hip` (set only on them) tells
    them apart, and `gcnArchName` ("gfx942:sramecc+:xnack-") names the architecture before its
    feature flags. NVIDIA GPUs are named by compute capability.
    """
    if hip_version:
        return gcn_arch_name.split(":")[0]
    return f"sm_{major}{minor}"


def device_arch(device: torch.device) -> str:
    """The architecture of a GPU device as `table_for_arch` names it."""
    properties = torch.cuda.get_device_properties(device)
    gcn_arch_name = str(getattr(properties, "gcnArchName", ""))
    return arch_from_properties(torch.version.hip, gcn_arch_name, properties.major, properties.minor)


@functools.cache
def _table_for_device(device: torch.device) -> LaunchTable:
    return table_for_arch(device_arch(device))


def launch_table_for(device: torch.device) -> LaunchTable:
    """The launch table for kernels running on `device`.

    Off a GPU the kernels run in Triton's interpreter, which ignores warps and stages; it gets the
    CUDA table, whose tiles the CPU tests have always checked.
    """
    if device.type != "cuda":
        return CUDA
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _table_for_device(device)
