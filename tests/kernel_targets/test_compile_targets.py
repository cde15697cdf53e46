"""Every Triton kernel of the engine compiles for MI300X, MI355X, MI250X, H100/H200 and A100 with
the engine's launch configurations, without a register spill or more LDS than a program may use.

No GPU is needed: Triton compiles for a named target down to an AMD code object or an NVIDIA
cubin. The compile runs once for the module (two worker processes, an empty Triton cache each)."""

from __future__ import annotations

import json

import pytest

from baton_engine.model.kernels.kernel_compile import TARGETS, TARGETS_BY_NAME, CompileRun, compile_reports

# One compile of every launch for the module: docs/amd.md's launch counts, ~10 CPU-minutes.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

#: Every kernel the engine launches, by target: a kernel added without a declared scenario fails
#: the coverage test; one declared here but no longer launched fails the per-target test.
ENGINE_KERNELS = [
    "_decode_reduce_kernel",
    "_decode_split_kernel",
    "_gemv_kernel",
    "_gemv_qkv_rope_kernel",
    "_gemv_residual_kernel",
    "_gemv_silu_kernel",
    "_moe_down_kernel",
    "_moe_gate_up_kernel",
    "_multi_query_split_kernel",
    "_prefill_kernel",
    "_rms_norm_kernel",
    "_rotary_cache_kernel",
    "_silu_mul_kernel",
    "_sum_squares_kernel",
]
#: The FP8 linear layer's kernels, compiled for the targets with an FP8 format only.
FP8_KERNELS = ["_fp8_gemm_kernel", "_quantize_rows_kernel"]


def expected_kernels(target: str) -> list[str]:
    return sorted(ENGINE_KERNELS + (FP8_KERNELS if TARGETS_BY_NAME[target].fp8_dtype else []))


@pytest.fixture(scope="module")
def compiled() -> CompileRun:
    return compile_reports(workers=2)


def test_every_jit_function_is_launched_or_called_by_a_declared_scenario(compiled: CompileRun) -> None:
    assert compiled.problems == []


@pytest.mark.parametrize("target", [target.name for target in TARGETS])
def test_every_kernel_compiles_without_spills_for(target: str, compiled: CompileRun) -> None:
    reports = compiled.for_target(target)
    assert sorted({report.kernel for report in reports}) == expected_kernels(target)
    limits = TARGETS_BY_NAME[target]
    failures = [
        f"{report.kernel} {report.constants} warps={report.num_warps} stages={report.num_stages} "
        f"({report.cases[0]}): {report.failure(limits)}"
        for report in reports
        if report.failure(limits) is not None
    ]
    assert failures == []
    assert all(report.occupancy is not None and report.occupancy.programs >= 1 for report in reports)


def test_amd_register_occupancy_equals_llvm_own(compiled: CompileRun) -> None:
    """Our waves-per-SIMD from VGPRs and SGPRs is the number LLVM's AMDGPU backend prints."""
    amd = [report for report in compiled.reports if TARGETS_BY_NAME[report.target].backend == "hip"]
    assert amd
    mismatches = [
        (report.qualname, report.constants, report.registers, report.sgprs, waves, report.llvm_occupancy)
        for report in amd
        for waves in [None if report.occupancy is None else report.occupancy.waves_by_registers]
        if waves != report.llvm_occupancy
    ]
    assert mismatches == []


def test_each_dtype_and_head_dim_is_compiled_for(compiled: CompileRun) -> None:
    for target in TARGETS:
        cases = {case.split()[0] for report in compiled.for_target(target.name) for case in report.cases}
        dtypes = ("bfloat16", "float16", "float32", *(("fp8",) if target.fp8_dtype else ()))
        assert cases == {
            f"{model}/{dtype}/bs16" for model in ("smollm2-135m", "llama-3.1-70b") for dtype in dtypes
        }
        head_dims = {
            r.constants["HEAD_DIM"] for r in compiled.for_target(target.name) if "HEAD_DIM" in r.constants
        }
        assert head_dims == {64, 128}


def test_bench_amd_compile_reports_the_test_run(compiled: CompileRun) -> None:
    """`python -m bench.amd_compile --quick --json` is this module's run; its JSON, from the same
    compiled launches: per target and kernel the worst registers, LDS and occupancy; with
    `--launches`, one row per launch, each naming its launch-table entry."""
    from bench import amd_compile

    result = json.loads(json.dumps(amd_compile.build_result(compiled, quick=True, launches=True)))
    assert (result["bench"], result["quick"], result["failures"], result["problems"]) == (
        "amd_compile",
        True,
        0,
        [],
    )
    assert result["failing_launches"] == []
    assert sorted(result["summary"]) == sorted(target.name for target in TARGETS)
    for name, summary in result["summary"].items():
        assert sorted(summary["kernels"]) == expected_kernels(name), name
        assert sorted(summary["kernels_float32"]) == ENGINE_KERNELS, name
        assert summary["launches"] == len(compiled.for_target(name))
        assert summary["spilling"] == summary["over_lds"] == summary["errors"] == 0
        if TARGETS_BY_NAME[name].backend == "hip":  # the AMD table spills in no dtype
            assert summary["spilling_float32"] == 0, name
        for kernel, row in summary["kernels"].items():
            reports = [r for r in compiled.for_target(name) if r.kernel == kernel and r.dtype != "float32"]
            assert row["launches"] == len(reports)
            assert row["max_registers"] == max(r.registers for r in reports)
            assert row["max_lds_bytes"] == max(r.shared_bytes for r in reports)
            assert row["spills"] == 0
            assert 0 < row["min_waves_per_simd"] <= summary["max_waves_per_simd"]
    assert len(result["launches"]) == result["cost"]["launches"] == len(compiled.reports)
    assert {row["entry"] for row in result["launches"]} == {
        "decode_unsplit", "decode_split", "split_reduce", "verify_unsplit", "verify_split",
        "prefill_small_head", "prefill_large_head", "rms_norm", "rotary", "silu",
        "gemv:qkv", "gemv:o,down", "gemv:gate_up", "gemv:lm_head", "gemv:sum_squares",
        "moe", "gemm_tiles", "quantize_rows",
    }  # fmt: skip


def test_the_docs_launch_counts_are_the_compiled_launches(compiled: CompileRun) -> None:
    """docs/amd.md's launch counts per target and kernel module are this run's (regenerate them
    with python -m bench.amd_compile --write-launch-counts)."""
    from bench import amd_compile

    counts = amd_compile.launch_counts((report.target, report.module) for report in compiled.reports)
    assert amd_compile.build_result(compiled, quick=True)["launch_counts"] == counts
    page = amd_compile.DOCS_PAGE.read_text()
    rendered = amd_compile.render_launch_counts(counts)
    assert amd_compile.replace_block(page, "launch-counts", rendered) == page, (
        "docs/amd.md's launch counts are stale: run python -m bench.amd_compile --write-launch-counts"
    )
