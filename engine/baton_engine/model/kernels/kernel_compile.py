"""Compile every Triton kernel of the engine for AMD and NVIDIA GPUs on any machine, GPU or not.

Triton compiles for a target named by a `GPUTarget` without its GPU: down to an AMD code object
(amdgcn, hsaco) or an NVIDIA cubin (ptxas ships in the wheel). This module

1. runs the kernel modules' declared scenarios (`kernel_registry`) with Triton's launches
   *captured*: a driver naming the target stands in for the GPU's, and Triton's
   ``jit_cache_hook`` records each launch's specialization (argument types, alignment,
   compile-time constants, warps, stages) and stops it before it compiles or runs — so what is
   compiled is exactly what the engine's launchers ask for on that target;
2. compiles each distinct launch once (`triton.compile`) and reads registers, spills and LDS /
   shared memory from the compiled kernel (the AMDHSA metadata of the amdgcn; ptxas's report);
3. estimates occupancy from those numbers and the target's limits (`CompileTarget`);
4. checks coverage: every ``@triton.jit`` function of the package is launched by a scenario or
   called by a launched kernel.

Compiling one launch takes up to a second of a CPU core: `compile_reports` shards the work over
worker processes (``python -m baton_engine.model.kernels.kernel_compile --shard I/N``), each with
its own empty Triton cache, so nothing is reused from an earlier run.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import inspect
import io
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from baton_engine.model.kernels.launch_table import LAUNCH_TABLES, Launch, LaunchTable

#: Workers' environment: compiled kernels (never Triton's interpreter), FP fusion as the engine's
#: launches get it by default (Triton 3.9 warns unless it is named).
WORKER_ENV = {"TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}


def table_from_dict(data: dict[str, Any]) -> LaunchTable:
    """A `LaunchTable` from its `dataclasses.asdict` form (how workers receive one)."""
    entries: dict[str, Any] = {k: Launch(**v) for k, v in data.items() if k != "name"}
    return LaunchTable(name=data["name"], **entries)


@dataclass(frozen=True)
class CompileTarget:
    """A GPU architecture the kernels are compiled for, with the limits occupancy is computed from.

    AMD: a CU has `simds` SIMDs; each holds at most `max_waves_per_simd` wavefronts and a file of
    `registers_per_simd` VGPRs per lane (architected and accumulation registers share it on
    CDNA2-4), allocated in granules of `register_granule`; the CU's `shared_bytes` of LDS are
    shared by its workgroups. NVIDIA: an SM has `simds` sub-partitions (warp schedulers) of
    `max_waves_per_simd` warps each, `registers_per_simd` 32-bit registers each (allocated per
    warp in granules of `register_granule`), and `shared_bytes` of shared memory.
    """

    name: str
    gpus: str
    backend: Literal["hip", "cuda"]
    arch: str | int
    warp_size: int
    simds: int
    max_waves_per_simd: int
    registers_per_simd: int
    register_granule: int
    shared_bytes: int
    #: The most shared memory / LDS one program (workgroup, block) may allocate.
    max_shared_per_program: int
    #: Shared memory the hardware reserves per resident block (1 KiB on sm_80+; 0 on AMD).
    shared_reserved_per_program: int
    #: Resident programs per CU / SM at most.
    max_programs: int
    #: torch's name of the target's FP8 (e4m3) format; None: no FP8 in hardware.
    fp8_dtype: str | None

    def gpu_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.backend, self.arch, self.warp_size)


def _cdna(name: str, gpus: str, lds_bytes: int, fp8_dtype: str | None) -> CompileTarget:
    """A CDNA2-4 GPU: 4 SIMDs per CU of at most 8 waves, 512 unified VGPRs per lane in granules
    of 8, at most 16 workgroups per CU, and `lds_bytes` of LDS per CU (one workgroup may use it
    all)."""
    return CompileTarget(
        name=name, gpus=gpus, backend="hip", arch=name, warp_size=64, simds=4, max_waves_per_simd=8,
        registers_per_simd=512, register_granule=8, shared_bytes=lds_bytes, max_shared_per_program=lds_bytes,
        shared_reserved_per_program=0, max_programs=16, fp8_dtype=fp8_dtype,
    )  # fmt: skip


def _nvidia(capability: int, gpus: str, smem_bytes: int, fp8_dtype: str | None) -> CompileTarget:
    """An sm_80+ GPU: 4 sub-partitions per SM of at most 16 warps and 16384 registers (allocated
    per warp in granules of 256), at most 32 blocks per SM, `smem_bytes` of shared memory per SM,
    of which 1 KiB is reserved per block and one block may use all but that."""
    return CompileTarget(
        name=f"sm_{capability}", gpus=gpus, backend="cuda", arch=capability, warp_size=32, simds=4,
        max_waves_per_simd=16, registers_per_simd=16384, register_granule=256, shared_bytes=smem_bytes,
        max_shared_per_program=smem_bytes - 1024, shared_reserved_per_program=1024, max_programs=32,
        fp8_dtype=fp8_dtype,
    )  # fmt: skip


TARGETS: tuple[CompileTarget, ...] = (
    _cdna("gfx942", "MI300X, MI325X (CDNA3)", 64 * 1024, "float8_e4m3fnuz"),
    _cdna("gfx950", "MI350X, MI355X (CDNA4)", 160 * 1024, "float8_e4m3fn"),
    _cdna("gfx90a", "MI250X, MI210 (CDNA2)", 64 * 1024, None),
    _nvidia(90, "H100, H200", 228 * 1024, "float8_e4m3fn"),
    _nvidia(80, "A100", 164 * 1024, None),
)
TARGETS_BY_NAME = {target.name: target for target in TARGETS}


@dataclass(frozen=True)
class Occupancy:
    """Resident programs and waves of one compiled kernel on one target, and what limits them."""

    #: Programs (workgroups / blocks) resident per CU / SM.
    programs: int
    #: Wavefronts (AMD) or warps (NVIDIA) resident per SIMD / SM sub-partition, on average.
    waves_per_simd: float
    #: waves_per_simd over the target's maximum (0..1).
    fraction: float
    #: The resource that caps `programs`: "registers", "sgprs", "shared", "waves" or "programs".
    limiter: str
    #: Waves per SIMD the registers alone allow (AMD: VGPRs and SGPRs, what LLVM prints as
    #: "; Occupancy" for Triton's kernels, whose LDS is allocated at launch).
    waves_by_registers: int


def amd_sgpr_waves(sgprs: int, max_waves: int) -> int:
    """Waves per SIMD the SGPRs allow on GFX9 (CDNA): 800 per SIMD, as LLVM's AMDGPU backend counts."""
    for limit, waves in ((80, 10), (88, 9), (100, 8)):
        if sgprs <= limit:
            return min(waves, max_waves)
    return min(7, max_waves)


def occupancy(
    target: CompileTarget, num_warps: int, registers: int, shared: int, sgprs: int = 0
) -> Occupancy:
    """Occupancy of a kernel of `num_warps` waves / warps per program using `registers` per lane
    (AMD: VGPRs including AGPRs; NVIDIA: registers per thread) and `shared` bytes per program."""
    granule = target.register_granule
    if target.backend == "hip":
        allocated = max(granule, -(-registers // granule) * granule)
        by_registers = min(target.max_waves_per_simd, target.registers_per_simd // allocated)
        by_sgprs = amd_sgpr_waves(sgprs, target.max_waves_per_simd)
        per_simd = min(by_registers, by_sgprs)
        register_limiter = "registers" if by_registers <= by_sgprs else "sgprs"
    else:
        per_warp = max(granule, -(-(registers * target.warp_size) // granule) * granule)
        by_registers = min(target.max_waves_per_simd, target.registers_per_simd // per_warp)
        per_simd = by_registers
        register_limiter = "registers"
    # In this order, so a tie names the binding resource: registers that allow every wave slot
    # are not the limit.
    limits = {
        "waves": target.max_waves_per_simd * target.simds // num_warps,
        register_limiter: per_simd * target.simds // num_warps,
        "programs": 40 if target.backend == "hip" and num_warps == 1 else target.max_programs,
    }
    if shared:
        limits["shared"] = target.shared_bytes // (shared + target.shared_reserved_per_program)
    limiter = min(limits, key=lambda name: limits[name])
    programs = limits[limiter]
    waves = programs * num_warps / target.simds
    return Occupancy(
        programs=programs,
        waves_per_simd=waves,
        fraction=round(waves / target.max_waves_per_simd, 4),
        limiter=limiter,
        waves_by_registers=per_simd,
    )


#: Dtypes whose launches may spill without failing the check: float32 runs only in the parity
#: tests (IEEE float32 dots run on FMA units on NVIDIA and spill the H200's 16-bit tiles).
SPILLS_ALLOWED = ("float32",)


@dataclass
class KernelReport:
    """One compiled launch: what was compiled, for which target, and what the compiler made of it."""

    kernel: str
    module: str
    target: str
    #: The scenario cases that launch it ("smollm2-135m/bfloat16/bs16 _decode_launches"...).
    cases: list[str]
    #: The cases' activation dtype ("bfloat16", "float16", "float32", "fp8").
    dtype: str
    #: Compile-time constants and launch options (num_warps, num_stages) as launched.
    constants: dict[str, Any]
    num_warps: int
    num_stages: int
    compile_seconds: float = 0.0
    #: CPU time of the compile, ptxas and the linker included.
    cpu_seconds: float = 0.0
    error: str | None = None
    #: VGPRs per lane (AMD, AGPRs included) or registers per thread (NVIDIA).
    registers: int = 0
    #: AMD: SGPRs per wave (0 on NVIDIA).
    sgprs: int = 0
    #: Registers spilled: AMD VGPR + SGPR spill counts; NVIDIA bytes of spill stores.
    spills: int = 0
    #: AMD: the SGPRs among `spills` (spilled to VGPR lanes rather than to memory).
    sgpr_spills: int = 0
    #: Scratch / stack bytes per lane or thread (spills, or arrays the compiler put in memory).
    scratch_bytes: int = 0
    #: Shared memory (NVIDIA) or LDS (AMD) bytes per program.
    shared_bytes: int = 0
    occupancy: Occupancy | None = None
    #: AMD: the waves per SIMD LLVM computed from the registers ("; Occupancy" in the amdgcn).
    llvm_occupancy: int | None = None

    @property
    def qualname(self) -> str:
        """``target:module.kernel``, shared by the kernel's launches on the target."""
        return f"{self.target}:{self.module}.{self.kernel}"

    def failure(self, target: CompileTarget) -> str | None:
        """Why this launch would fail, or run degraded, on the target: a compile error, more
        shared memory than one program may allocate (the launch fails), or spills (the 16-bit and
        FP8 dtypes the engine serves with; float32, the parity tests' dtype, may spill: it costs
        those tests time, never a result). None when it is clean."""
        if self.error is not None:
            return f"compile error: {self.error}"
        if self.spills and self.dtype not in SPILLS_ALLOWED:
            if target.backend == "cuda":
                return f"{self.spills} bytes of spill stores ({self.scratch_bytes} B stack frame)"
            return f"{self.spills} registers spilled ({self.scratch_bytes} scratch bytes)"
        if self.shared_bytes > target.max_shared_per_program:
            limit = target.max_shared_per_program
            return f"{self.shared_bytes} B of shared memory, over the {limit} B one program may use"
        return None


@dataclass(frozen=True)
class CapturedLaunch:
    """A launch as Triton's launcher specialized it, stopped before compiling."""

    fn: Any  # triton.runtime.jit.JITFunction
    module: str
    name: str
    signature: dict[str, str]
    constexprs: dict[tuple[int, ...], Any]
    attrs: dict[tuple[int, ...], Any]
    options: dict[str, Any]
    key: str

    def readable_constants(self) -> dict[str, Any]:
        names = self.fn.arg_names
        values = {names[path[0]]: value for path, value in self.constexprs.items() if len(path) == 1}
        return {
            name: value
            for name, value in values.items()
            if isinstance(value, (int, float, str, bool, type(None)))
        }


class _CaptureDriver:
    """Names a compile target where Triton's launcher asks the active GPU driver for one.

    Launches are stopped by the capture hook before they compile or run, so no GPU is touched;
    each target gets its own device index, so Triton's per-device launch caches stay apart.
    """

    def __init__(self, target: CompileTarget, device: int) -> None:
        self._target = target.gpu_target()
        self._device = device

    def get_current_target(self) -> Any:
        return self._target

    def get_current_device(self) -> int:
        return self._device

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


@contextlib.contextmanager
def captured_launches(target: CompileTarget) -> Iterator[list[CapturedLaunch]]:
    """Within the block, Triton launches are recorded for `target` instead of compiled and run."""
    from triton import knobs
    from triton.runtime.driver import driver

    launches: list[CapturedLaunch] = []

    def hook(*, fn: Any, compile: dict[str, Any], key: Any, **_: Any) -> bool:
        data = json.loads(compile["specialization_data"])
        options = {k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()}
        jit_fn = fn.jit_function
        launches.append(
            CapturedLaunch(
                fn=jit_fn,
                module=jit_fn.fn.__module__,
                name=jit_fn.fn.__name__,
                signature=dict(compile["signature"]),
                constexprs=dict(compile["constants"]),
                attrs=dict(compile["configs"][0]),
                options=options,
                key=f"{jit_fn.fn.__module__}.{jit_fn.fn.__name__}:{key}",
            )
        )
        return True  # skip compiling and launching

    try:
        previous = driver.active
    except RuntimeError:  # no GPU driver on this machine: nothing to restore
        previous = None
    previous_hook = knobs.runtime.jit_cache_hook
    driver.set_active(_CaptureDriver(target, 1000 + TARGETS.index(target)))
    knobs.runtime.jit_cache_hook = hook
    try:
        yield launches
    finally:
        knobs.runtime.jit_cache_hook = previous_hook
        if previous is not None:
            driver.set_active(previous)


def capture_target(
    target: CompileTarget, table: LaunchTable | None = None
) -> tuple[list[tuple[CapturedLaunch, str, str]], list[str]]:
    """Every (launch, case label, case dtype) the declared scenarios make for `target` (under its own launch
    table, or `table`), and the scenarios that did not launch exactly the kernels they declare
    (each as a message)."""
    import torch

    from baton_engine.model.kernels import kernel_registry
    from baton_engine.model.kernels.launch_table import table_for_arch

    kernel_registry.import_kernel_modules()
    table = table_for_arch(target.name) if table is None else table
    fp8 = getattr(torch, target.fp8_dtype) if target.fp8_dtype else None
    found: list[tuple[CapturedLaunch, str, str]] = []
    problems: list[str] = []
    for decl in kernel_registry.scenarios():
        launched: set[str] = set()
        cases = list(kernel_registry.engine_cases(table, fp8, decl.dtypes))
        if not cases:  # an FP8-only scenario on a target without FP8
            continue
        for case in cases:
            with captured_launches(target) as launches:
                decl.run(case)
            label = f"{case.label()} {decl.name}"
            found.extend((launch, label, case.case_dtype) for launch in launches)
            launched.update(launch.name for launch in launches)
        missing = sorted(set(decl.kernels) - launched)
        extra = sorted(launched - set(decl.kernels))
        if missing or extra:
            problems.append(
                f"{decl.module}.{decl.name}: launched {sorted(launched)}, declares {list(decl.kernels)}"
            )
    return found, problems


def jit_python_function(value: Any) -> Any:
    """The Python function under a ``@triton.jit`` object (compiled or interpreted), else None."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return value.fn if isinstance(value, (JITFunction, InterpretedFunction)) else None


def uncovered_jit_functions(launched: Sequence[Any], root: Path | None = None) -> list[str]:
    """``@triton.jit`` functions under `root` (default: the package) that are neither in
    `launched` nor called, directly or through other jit functions, by one in `launched`."""
    import importlib

    from baton_engine.model.kernels.kernel_registry import find_jit_functions

    covered: set[str] = set()
    pending = [jit_python_function(fn) for fn in launched]
    while pending:
        function = pending.pop()
        name = f"{function.__module__}.{function.__name__}"
        if name in covered:
            continue
        covered.add(name)
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                called = jit_python_function(function.__globals__.get(node.func.id))
                if called is not None:
                    pending.append(called)
    missing = []
    for ref in find_jit_functions(root):
        if jit_python_function(getattr(importlib.import_module(ref.module), ref.name, None)) is None:
            missing.append(
                f"{ref.qualname} ({ref.path}:{ref.line}) is not a module-level @triton.jit function"
            )
        elif ref.qualname not in covered:
            missing.append(f"{ref.qualname} ({ref.path}:{ref.line}) is launched by no declared scenario")
    return missing


_AMD_FIELDS = {
    "vgpr_count": r"^\s+\.vgpr_count:\s+(\d+)",
    "sgpr_count": r"^\s+\.sgpr_count:\s+(\d+)",
    "vgpr_spill_count": r"^\s+\.vgpr_spill_count:\s+(\d+)",
    "sgpr_spill_count": r"^\s+\.sgpr_spill_count:\s+(\d+)",
    "private_segment_fixed_size": r"^\s+\.private_segment_fixed_size:\s+(\d+)",
    "llvm_occupancy": r"^\s*; Occupancy:\s+(\d+)",
}
_PTXAS_FIELDS = {
    "registers": r"Used (\d+) registers",
    "spill_stores": r"(\d+) bytes spill stores",
    "spill_loads": r"(\d+) bytes spill loads",
    "stack": r"(\d+) bytes stack frame",
}


def _fields(text: str, patterns: dict[str, str], what: str) -> dict[str, int]:
    values = {}
    for name, pattern in patterns.items():
        matches = re.findall(pattern, text, flags=re.MULTILINE)
        if len(matches) != 1:
            raise ValueError(f"{what}: expected one {name!r}, found {len(matches)}")
        values[name] = int(matches[0])
    return values


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # ptxas, the linker
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def compile_launch(launch: CapturedLaunch, target: CompileTarget, report: KernelReport) -> None:
    """Compile `launch` for `target` and fill `report` with what the compiler produced."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource

    source = ASTSource(launch.fn, launch.signature, launch.constexprs, launch.attrs)
    log = io.StringIO()
    start = time.perf_counter()
    cpu_start = _cpu_seconds()
    previous = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True  # ptxas's -v report (registers, spills), printed to stdout
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(source, target=target.gpu_target(), options=launch.options)
    except Exception as exc:  # a compile error is the finding: report it, keep compiling the rest
        report.error = f"{type(exc).__name__}: {str(exc).strip()[-2000:]}"
        return
    finally:
        knobs.nvidia.dump_ptxas_log = previous
        report.compile_seconds = round(time.perf_counter() - start, 3)
        report.cpu_seconds = round(_cpu_seconds() - cpu_start, 3)
    report.shared_bytes = int(compiled.metadata.shared)
    if target.backend == "hip":
        amd = _fields(compiled.asm["amdgcn"], _AMD_FIELDS, f"{launch.name} amdgcn")
        report.registers = amd["vgpr_count"]
        report.sgprs = amd["sgpr_count"]
        report.spills = amd["vgpr_spill_count"] + amd["sgpr_spill_count"]
        report.sgpr_spills = amd["sgpr_spill_count"]
        report.scratch_bytes = amd["private_segment_fixed_size"]
        report.llvm_occupancy = amd["llvm_occupancy"]
    else:
        ptxas = _fields(log.getvalue(), _PTXAS_FIELDS, f"{launch.name} ptxas log")
        report.registers = ptxas["registers"]
        report.spills = ptxas["spill_stores"]
        report.scratch_bytes = ptxas["stack"]
    report.occupancy = occupancy(
        target, report.num_warps, report.registers, report.shared_bytes, report.sgprs
    )


@dataclass
class WorkerResult:
    """What one worker found: its share of the compiled launches, and the coverage problems."""

    reports: list[KernelReport] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    #: Distinct launches over all targets (before sharding).
    launches: int = 0


def distinct_launches(
    targets: Sequence[CompileTarget], table: LaunchTable | None = None
) -> tuple[list[tuple[CompileTarget, CapturedLaunch, str, list[str]]], list[str]]:
    """Every distinct launch of every target (in a stable order) with the cases making it, and
    the coverage problems (scenarios not launching what they declare, uncovered jit functions)."""
    work: list[tuple[CompileTarget, CapturedLaunch, str, list[str]]] = []
    problems: list[str] = []
    launched_fns: dict[str, Any] = {}
    for target in targets:
        found, target_problems = capture_target(target, table)
        problems.extend(f"{target.name}: {p}" for p in target_problems)
        by_key: dict[str, tuple[CapturedLaunch, str, list[str]]] = {}
        for launch, label, dtype in found:
            by_key.setdefault(launch.key, (launch, dtype, []))[2].append(label)
            launched_fns[launch.name] = launch.fn
        work.extend((target, launch, dtype, labels) for launch, dtype, labels in by_key.values())
    problems.extend(uncovered_jit_functions(list(launched_fns.values())))
    return work, sorted(set(problems))


def run_worker(
    targets: Sequence[CompileTarget], shard: int, shards: int, table: LaunchTable | None = None
) -> WorkerResult:
    """Compile this worker's share (every `shards`-th distinct launch, from `shard`)."""
    work, problems = distinct_launches(targets, table)
    result = WorkerResult(problems=problems if shard == 0 else [], launches=len(work))
    for index, (target, launch, dtype, labels) in enumerate(work):
        if index % shards != shard:
            continue
        report = KernelReport(
            kernel=launch.name,
            module=launch.module,
            target=target.name,
            cases=labels,
            dtype=dtype,
            constants=launch.readable_constants(),
            num_warps=int(launch.options["num_warps"]),
            num_stages=int(launch.options["num_stages"]),
        )
        compile_launch(launch, target, report)
        result.reports.append(report)
    return result


def _report_from_json(data: dict[str, Any]) -> KernelReport:
    occ = data.pop("occupancy")
    report = KernelReport(**data)
    report.occupancy = None if occ is None else Occupancy(**occ)
    return report


@dataclass
class CompileRun:
    """Every compiled launch of a run over some targets, and the run's cost."""

    reports: list[KernelReport]
    problems: list[str]
    launches: int
    workers: int
    wall_seconds: float

    def for_target(self, name: str) -> list[KernelReport]:
        return [report for report in self.reports if report.target == name]


def compile_reports(
    targets: Sequence[str] | None = None,
    workers: int = 2,
    table: str | LaunchTable | None = None,
    timeout: float = 1800,
) -> CompileRun:
    """Compile every kernel launch for `targets` (default: all) in `workers` processes, under each
    target's launch table or, for all of them, `table` (or the table of that name: "cuda" on
    AMD targets is the reference of what the H200's values would do there)."""
    names = [target.name for target in TARGETS] if targets is None else list(targets)
    unknown = sorted(set(names) - set(TARGETS_BY_NAME))
    if unknown:
        raise ValueError(f"unknown compile targets {unknown}; known: {sorted(TARGETS_BY_NAME)}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="baton-kernel-compile-") as scratch:
        table_args: list[str] = []
        if table is not None:
            table_path = os.path.join(scratch, "table.json")
            with open(table_path, "w", encoding="utf-8") as f:
                json.dump(asdict(LAUNCH_TABLES[table] if isinstance(table, str) else table), f)
            table_args = ["--table-json", table_path]
        processes: list[tuple[subprocess.Popen[bytes], str, str]] = []
        try:
            for shard in range(workers):
                env = {**os.environ, **WORKER_ENV, "TRITON_CACHE_DIR": os.path.join(scratch, f"cache{shard}")}
                out_path = os.path.join(scratch, f"shard{shard}.json")
                log_path = os.path.join(scratch, f"shard{shard}.log")
                command = [
                    sys.executable, "-m", __name__,  # this module, wherever the package puts it
                    "--targets", ",".join(names), "--shard", f"{shard}/{workers}", "--out", out_path,
                    *table_args,
                ]  # fmt: skip
                # stderr to a file (a full pipe would stall the worker); a process group of its own,
                # so that a killed run's workers can be found by pid.
                with open(log_path, "wb") as log:
                    worker = subprocess.Popen(command, env=env, stderr=log, start_new_session=True)
                processes.append((worker, out_path, log_path))
            deadline = time.monotonic() + timeout
            for process, _, _ in processes:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
        finally:  # interrupted or timed out: stop the workers, leave no process behind
            for process, _, _ in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        reports: list[KernelReport] = []
        problems: list[str] = []
        launches = 0
        failures = []
        for process, out_path, log_path in processes:
            if process.returncode != 0:
                with open(log_path, encoding="utf-8", errors="replace") as f:
                    failures.append(f"worker exited {process.returncode}: {f.read()[-4000:]}")
                continue
            with open(out_path, encoding="utf-8") as f:
                data = json.load(f)
            reports.extend(_report_from_json(r) for r in data["reports"])
            problems.extend(data["problems"])
            launches = data["launches"]
        if failures:
            raise RuntimeError("\n".join(failures))
    reports.sort(
        key=lambda r: (names.index(r.target), r.module, r.kernel, json.dumps(r.constants, sort_keys=True))
    )
    return CompileRun(reports, problems, launches, workers, round(time.perf_counter() - start, 1))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Compile worker: one shard of the engine's kernel launches.")
    parser.add_argument("--targets", required=True, help="comma-separated target names")
    parser.add_argument("--shard", default="0/1", help="I/N: compile every N-th launch from the I-th")
    parser.add_argument("--out", required=True, help="where to write the shard's JSON")
    parser.add_argument(
        "--table-json", default=None, help="a launch table for every target (default: each its own)"
    )
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("TRITON_INTERPRET is set: kernels would be interpreted, not compiled")
    shard, shards = (int(part) for part in args.shard.split("/"))
    targets = [TARGETS_BY_NAME[name] for name in args.targets.split(",")]
    table = None
    if args.table_json:
        with open(args.table_json, encoding="utf-8") as f:
            table = table_from_dict(json.load(f))
    result = run_worker(targets, shard, shards, table)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(asdict(result), f)


if __name__ == "__main__":
    main()
