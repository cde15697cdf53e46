"""Registers, spills, LDS and occupancy of every engine Triton kernel on AMD and NVIDIA GPUs.

``python -m bench.amd_compile --json`` compiles every launch the engine's kernel modules declare
(`baton_engine.model.kernels.kernel_registry`) for gfx942 (MI300X), gfx950 (MI355X), gfx90a (MI250X),
sm_90 (H100/H200) and sm_80 (A100) on this machine — no GPU needed — and reports per kernel and
target: VGPRs / registers per thread, SGPRs (AMD), spills, scratch, LDS / shared bytes per
program, and the estimated waves per SIMD (warps per SM sub-partition on NVIDIA) against the
target's maximum. The reference in the same run: the AMD targets compiled with the NVIDIA
launch table (what the H200-tuned values would do on AMD), with its spills and LDS overflows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from baton_engine.model.kernels.kernel_compile import (
    SPILLS_ALLOWED,
    TARGETS,
    TARGETS_BY_NAME,
    CompileRun,
    KernelReport,
    compile_reports,
    distinct_launches,
)
from baton_engine.model.kernels.launch_table import (
    CUDA,
    LAUNCH_TABLES,
    ROCM,
    Launch,
    LaunchTable,
    table_for_arch,
)

DOCS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "amd.md"

#: Candidates (num_warps, num_stages, block_n) of `--sweep` for the attention entries of the AMD
#: table: the H200's lanes per program (half its warps) and its neighbours, with 1 and 2 stages.
SWEEP: dict[str, list[tuple[int, int, int]]] = {
    "decode_unsplit": [(1, 1, 64), (1, 2, 64), (2, 1, 64), (2, 2, 64), (4, 1, 64), (4, 2, 64), (2, 1, 32)],
    "decode_split": [(2, 1, 64), (2, 2, 64), (4, 1, 64), (4, 2, 64), (8, 1, 64), (4, 1, 32), (8, 2, 64)],
    "verify_unsplit": [(2, 1, 64), (2, 2, 64), (4, 1, 64), (4, 2, 64), (2, 1, 32), (4, 1, 32), (8, 1, 32)],
    "verify_split": [(4, 1, 64), (4, 2, 64), (8, 1, 64), (4, 1, 32), (8, 1, 32), (8, 2, 32), (2, 1, 32)],
    "prefill_small_head": [
        (2, 1, 64),
        (2, 2, 64),
        (4, 1, 64),
        (4, 2, 64),
        (8, 1, 64),
        (4, 1, 32),
        (8, 2, 64),
    ],
    "prefill_large_head": [
        (2, 1, 32),
        (2, 2, 32),
        (4, 1, 32),
        (4, 2, 32),
        (8, 1, 32),
        (4, 1, 16),
        (8, 2, 32),
    ],
}


def table_entry(kernel: str, constants: dict[str, Any]) -> str:
    """The launch-table entry a compiled launch of `kernel` with these constants came from."""
    if kernel == "_decode_split_kernel":
        return "decode_unsplit" if constants["NUM_SPLITS"] == 1 else "decode_split"
    if kernel == "_multi_query_split_kernel":
        return "verify_unsplit" if constants["NUM_SPLITS"] == 1 else "verify_split"
    if kernel == "_prefill_kernel":
        return "prefill_small_head" if constants["HEAD_DIM_PAD"] <= 64 else "prefill_large_head"
    return {
        "_decode_reduce_kernel": "split_reduce",
        "_rms_norm_kernel": "rms_norm",
        "_rotary_cache_kernel": "rotary",
        "_silu_mul_kernel": "silu",
        # The decode products take their launches from triton_gemv's GemvTable, by call site.
        "_gemv_qkv_rope_kernel": "gemv:qkv",
        "_gemv_residual_kernel": "gemv:o,down",
        "_gemv_silu_kernel": "gemv:gate_up",
        "_gemv_kernel": "gemv:lm_head",
        "_sum_squares_kernel": "gemv:sum_squares",
        "_moe_gate_up_kernel": "moe",
        "_moe_down_kernel": "moe",
        # Not in the launch table: these pick their tiles by the step's shape (`triton_fp8`).
        "_fp8_gemm_kernel": "gemm_tiles",
        "_quantize_rows_kernel": "quantize_rows",
    }[kernel]


def sweep(targets: list[str], workers: int) -> dict[str, Any]:
    """Each `SWEEP` candidate on the AMD targets: clean or not, and its worst occupancy and LDS
    over every dtype, head dim and tile the engine launches; which one the table holds."""
    import dataclasses

    table = table_for_arch(targets[0])
    rounds = max(len(candidates) for candidates in SWEEP.values())
    results: dict[str, list[dict[str, Any]]] = {entry: [] for entry in SWEEP}
    for index in range(rounds):
        changes = {}
        for entry, candidates in SWEEP.items():
            warps, stages, block_n = candidates[min(index, len(candidates) - 1)]
            changes[entry] = dataclasses.replace(
                getattr(table, entry), num_warps=warps, num_stages=stages, block_n=block_n
            )
        variant: LaunchTable = dataclasses.replace(table, **changes)
        run = compile_reports(targets, workers=workers, table=variant)
        for entry, candidates in SWEEP.items():
            if index >= len(candidates):
                continue
            reports = [r for r in run.reports if table_entry(r.kernel, r.constants) == entry]
            current = getattr(table, entry)
            results[entry].append(
                {
                    "num_warps": candidates[index][0],
                    "num_stages": candidates[index][1],
                    "block_n": candidates[index][2],
                    "launches": len(reports),
                    "failures": sum(1 for r in reports if r.failure(TARGETS_BY_NAME[r.target]) is not None),
                    "max_registers": max(r.registers for r in reports),
                    "max_lds_bytes": max(r.shared_bytes for r in reports),
                    "min_waves_per_simd": min(
                        r.occupancy.waves_per_simd if r.occupancy else 0.0 for r in reports
                    ),
                    "in_table": candidates[index] == (current.num_warps, current.num_stages, current.block_n),
                }
            )
    return results


def _rows(run: CompileRun) -> list[dict[str, Any]]:
    rows = []
    for report in run.reports:
        occupancy = report.occupancy
        rows.append(
            {
                "kernel": report.kernel,
                "entry": table_entry(report.kernel, report.constants),
                "target": report.target,
                "dtype": report.dtype,
                "cases": report.cases,
                "constants": report.constants,
                "num_warps": report.num_warps,
                "num_stages": report.num_stages,
                "registers": report.registers,
                "sgprs": report.sgprs,
                "spills": report.spills,
                "sgpr_spills": report.sgpr_spills,
                "scratch_bytes": report.scratch_bytes,
                "lds_bytes": report.shared_bytes,
                "waves_per_simd": None if occupancy is None else occupancy.waves_per_simd,
                "occupancy": None if occupancy is None else occupancy.fraction,
                "limiter": None if occupancy is None else occupancy.limiter,
                "llvm_occupancy": report.llvm_occupancy,
                "cpu_s": report.cpu_seconds,
                "failure": report.failure(TARGETS_BY_NAME[report.target]),
            }
        )
    return rows


def _per_kernel(reports: list[KernelReport]) -> dict[str, Any]:
    per_kernel: dict[str, Any] = {}
    for report in reports:
        entry = per_kernel.setdefault(
            report.kernel,
            {
                "launches": 0,
                "max_registers": 0,
                "max_sgprs": 0,
                "spills": 0,
                "max_lds_bytes": 0,
                "min_waves_per_simd": None,
            },
        )
        entry["launches"] += 1
        entry["max_registers"] = max(entry["max_registers"], report.registers)
        entry["max_sgprs"] = max(entry["max_sgprs"], report.sgprs)
        entry["spills"] += report.spills
        entry["max_lds_bytes"] = max(entry["max_lds_bytes"], report.shared_bytes)
        if report.occupancy is not None:
            waves = report.occupancy.waves_per_simd
            low = entry["min_waves_per_simd"]
            entry["min_waves_per_simd"] = waves if low is None else min(low, waves)
    return per_kernel


def _summary(run: CompileRun) -> dict[str, Any]:
    """Per target: failure counts, and per kernel the worst registers, LDS and occupancy of its
    launches, over the served dtypes (`kernels`) and over float32 (`kernels_float32`)."""
    summary: dict[str, Any] = {}
    for target in dict.fromkeys(report.target for report in run.reports):
        reports = run.for_target(target)
        limits = TARGETS_BY_NAME[target]
        served = [r for r in reports if r.dtype not in SPILLS_ALLOWED]
        summary[target] = {
            "launches": len(reports),
            "failures": sum(1 for r in reports if r.failure(limits) is not None),
            "spilling": sum(1 for r in served if r.spills),
            "spilling_float32": sum(1 for r in reports if r.spills and r.dtype in SPILLS_ALLOWED),
            "over_lds": sum(1 for r in reports if r.shared_bytes > limits.max_shared_per_program),
            "errors": sum(1 for r in reports if r.error is not None),
            "max_waves_per_simd": limits.max_waves_per_simd,
            "kernels": _per_kernel(served),
            "kernels_float32": _per_kernel([r for r in reports if r.dtype in SPILLS_ALLOWED]),
        }
    return summary


def _launch_cell(launch: Launch, unit: str) -> str:
    def count(n: int, what: str) -> str:
        return f"{n} {what}{'' if n == 1 else 's'}"

    tiles = [
        f"{name} {value}"
        for name, value in (("block_n", launch.block_n), ("block_m", launch.block_m))
        if value
    ]
    return ", ".join([count(launch.num_warps, unit), count(launch.num_stages, "stage"), *tiles])


def render_launch_table() -> str:
    """The docs' tables of every backend's launch parameters, and the reasons, from the code."""
    tables = list(LAUNCH_TABLES.values())
    unit = {table.name: "wave" if table is ROCM else "warp" for table in tables}
    label = {table.name: f"{'AMD' if table is ROCM else 'NVIDIA'} (`{table.name}`)" for table in tables}
    lines = ["| entry | " + " | ".join(label[t.name] for t in tables) + " |", "|---|" + "---|" * len(tables)]
    entries = [name for name in vars(CUDA) if name != "name"]
    for name in entries:
        cells = " | ".join(_launch_cell(getattr(t, name), unit[t.name]) for t in tables)
        lines.append(f"| `{name}` | {cells} |")
    for table in tables:
        own = [name for name in entries if table is CUDA or getattr(table, name) != getattr(CUDA, name)]
        lines += ["", f"Why `{table.name}`{'' if table is CUDA else ', where it differs from `cuda`'}:", ""]
        lines += [f"- `{name}`: {getattr(table, name).reason}" for name in own]
    return "\n".join(lines)


def _kib(size: int) -> str:
    return "0" if size == 0 else "< 1" if size < 1024 else f"{size / 1024:.4g}"


def render_results(result: dict[str, Any], kernels_key: str = "kernels") -> str:
    """The docs' table of a run: per kernel and target, "R / L / W": the most registers (VGPRs on
    AMD, per thread on NVIDIA) and KiB of LDS over its launches, and the fewest waves per SIMD
    (warps per SM sub-partition on NVIDIA) of the target's maximum."""
    summary = result["summary"]
    targets = list(summary)
    kernels = sorted({kernel for stats in summary.values() for kernel in stats[kernels_key]})
    header = [f"{t} (of {summary[t]['max_waves_per_simd']})" for t in targets]
    lines = ["| kernel | launches | " + " | ".join(header) + " |", "|---|---|" + "---|" * len(targets)]
    for kernel in kernels:
        # A kernel of FP8 operands is compiled only for the targets with an FP8 format ("-").
        rows = [summary[target][kernels_key].get(kernel) for target in targets]
        cells = [
            "-"
            if r is None
            else f"{r['max_registers']} / {_kib(r['max_lds_bytes'])} / {r['min_waves_per_simd']:g}"
            for r in rows
        ]
        launches = next(r["launches"] for r in rows if r is not None)
        lines.append(f"| `{kernel}` | {launches} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def replace_block(text: str, name: str, body: str) -> str:
    """`text` with the lines between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` replaced."""
    pattern = re.compile(rf"(<!-- {name}:start -->\n)(?:.*?\n)?(<!-- {name}:end -->)", re.S)
    if not pattern.search(text):
        raise ValueError(f"no {name} block in the page")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


def launch_counts(launches: Iterable[tuple[str, str]]) -> dict[str, dict[str, int]]:
    """Launches per target and kernel module (its last name) from (target, module) pairs."""
    counts: dict[str, dict[str, int]] = {}
    for target, module in launches:
        by_module = counts.setdefault(target, {})
        name = module.rpartition(".")[2]
        by_module[name] = by_module.get(name, 0) + 1
    return counts


def render_launch_counts(counts: dict[str, dict[str, int]]) -> str:
    """The docs' table of distinct launches per kernel module and target (targets in `TARGETS`'
    order), with each target's total and the total of all."""
    targets = [t.name for t in TARGETS if t.name in counts]
    modules = sorted({module for by_module in counts.values() for module in by_module})
    lines = ["| kernel module | " + " | ".join(targets) + " |", "|---|" + "---|" * len(targets)]
    for module in modules:
        cells = " | ".join(str(counts[t].get(module, 0)) for t in targets)
        lines.append(f"| `{module}` | {cells} |")
    totals = [sum(counts[t].values()) for t in targets]
    lines.append(f"| all ({sum(totals)}) | " + " | ".join(str(n) for n in totals) + " |")
    return "\n".join(lines)


def write_docs(result: dict[str, Any]) -> None:
    """Rewrite docs/amd.md's launch tables (from the code), compile results and launch counts
    (from `result`)."""
    page = replace_block(DOCS_PAGE.read_text(), "launch-table", render_launch_table())
    if "launch_counts" in result:
        page = replace_block(page, "launch-counts", render_launch_counts(result["launch_counts"]))
    page = replace_block(page, "compile-results", render_results(result))
    DOCS_PAGE.write_text(
        replace_block(page, "compile-results-float32", render_results(result, "kernels_float32"))
    )


def build_result(
    run: CompileRun, quick: bool, reference: CompileRun | None = None, launches: bool = False
) -> dict[str, Any]:
    """The benchmark's JSON object for a compile run (and the reference run, if any): per target
    and kernel the worst registers, LDS and occupancy over its launches; every failing launch in
    full, and every launch with `launches`."""
    import torch
    import triton

    targets = list(dict.fromkeys(report.target for report in run.reports))
    result: dict[str, Any] = {
        "bench": "amd_compile",
        "quick": quick,
        "triton": triton.__version__,
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_average_1m": round(os.getloadavg()[0], 2),
        "targets": {
            name: {
                "gpus": TARGETS_BY_NAME[name].gpus,
                "table": table_for_arch(name).name,
                "max_waves_per_simd": TARGETS_BY_NAME[name].max_waves_per_simd,
                "lds_bytes_per_cu": TARGETS_BY_NAME[name].shared_bytes,
                "fp8": TARGETS_BY_NAME[name].fp8_dtype,
            }
            for name in targets
        },
        "summary": _summary(run),
        "launch_counts": launch_counts((r.target, r.module) for r in run.reports),
        "failures": sum(1 for r in run.reports if r.failure(TARGETS_BY_NAME[r.target]) is not None),
        "problems": run.problems,
        "cost": {
            "launches": len(run.reports),
            "workers": run.workers,
            "wall_s": run.wall_seconds,
            "cpu_s": round(sum(r.cpu_seconds for r in run.reports), 1),
        },
        "failing_launches": [row for row in _rows(run) if row["failure"] is not None],
    }
    if launches:
        result["launches"] = _rows(run)
    if reference is not None:
        result["reference_cuda_table_on_amd"] = {
            name: {key: value for key, value in stats.items() if key != "kernels"}
            for name, stats in _summary(reference).items()
        }
        result["cost"]["reference_wall_s"] = reference.wall_seconds
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument(
        "--quick", action="store_true", help="the compile test's run: every target, no reference run"
    )
    parser.add_argument(
        "--targets", default=",".join(t.name for t in TARGETS), help="comma-separated targets"
    )
    parser.add_argument("--workers", type=int, default=2, help="compile processes")
    parser.add_argument("--launches", action="store_true", help="also print every compiled launch")
    parser.add_argument(
        "--write-docs",
        action="store_true",
        help="rewrite docs/amd.md's launch-table and results tables from this run",
    )
    parser.add_argument(
        "--docs-from",
        metavar="JSON",
        help="rewrite docs/amd.md's tables from a recorded run's JSON (no compile)",
    )
    parser.add_argument(
        "--write-launch-counts",
        action="store_true",
        help="rewrite docs/amd.md's launch counts from the declared scenarios (captured, no compile)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="compile the AMD table's candidate entries (slow) instead of the table",
    )
    args = parser.parse_args()
    if args.docs_from:
        with open(args.docs_from, encoding="utf-8") as f:
            write_docs(json.loads(f.read().strip().splitlines()[-1]))
        return
    if args.write_launch_counts:
        work, _ = distinct_launches(TARGETS)
        counts = launch_counts((target.name, launch.module) for target, launch, _, _ in work)
        DOCS_PAGE.write_text(
            replace_block(DOCS_PAGE.read_text(), "launch-counts", render_launch_counts(counts))
        )
        return
    if args.sweep:
        amd_targets = [t.name for t in TARGETS if t.backend == "hip"]
        print(json.dumps({"bench": "amd_compile", "quick": False, "sweep": sweep(amd_targets, args.workers)}))
        return
    targets = args.targets.split(",")
    run = compile_reports(targets, workers=args.workers)
    amd = [name for name in targets if TARGETS_BY_NAME[name].backend == "hip"]
    reference = None if args.quick or not amd else compile_reports(amd, workers=args.workers, table="cuda")
    result = build_result(run, args.quick, reference, args.launches)
    if args.write_docs:
        write_docs(result)
    if not args.json:
        for target, summary in result["summary"].items():
            for kernel, row in summary["kernels"].items():
                print(
                    f"{target:7} {kernel:26} launches={row['launches']} max_registers={row['max_registers']} "
                    f"spills={row['spills']} max_lds={row['max_lds_bytes']} "
                    f"min_waves/simd={row['min_waves_per_simd']}"
                )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
