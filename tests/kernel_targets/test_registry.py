"""The kernel registry's pure parts: finding ``@triton.jit`` functions, the coverage walk, the cases,
the occupancy model, and the launch table each device gets."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from baton_engine.model.kernels import kernel_registry
from baton_engine.model.kernels.kernel_compile import TARGETS_BY_NAME, occupancy, uncovered_jit_functions
from baton_engine.model.kernels.kernel_registry import CASE_VERIFY_QUERY_LENS, find_jit_functions
from baton_engine.model.kernels.launch_table import CUDA, LAUNCH_TABLES, arch_from_properties, table_for_arch
from baton_engine.worker.gpu.verify_batch import verify_query_lens

PACKAGE = """
import triton
import triton.language as tl


@triton.jit
def helper(x):
    return x * 2


@triton.jit
def nested_helper(x):
    return helper(x) + 1


@triton.jit
def launched(ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(ptr + offsets, nested_helper(tl.load(ptr + offsets)))


@triton.jit(do_not_specialize=["n"])
def forgotten(ptr, n):
    tl.store(ptr, n)


def not_a_kernel():
    pass
"""


@pytest.fixture
def kernel_package(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "fake_kernels"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "kernels.py").write_text(PACKAGE)
    (root / "plain.py").write_text("def f():\n    return 'triton.jit in a string only'\n")
    sys.path.insert(0, str(tmp_path))
    yield root
    sys.path.remove(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("fake_kernels")]:
        del sys.modules[name]


def test_find_jit_functions_reads_the_decorators_from_source(kernel_package: Path) -> None:
    found = find_jit_functions(kernel_package)
    assert [(ref.module, ref.name, ref.line) for ref in found] == [
        ("fake_kernels.kernels", "helper", 7),
        ("fake_kernels.kernels", "nested_helper", 12),
        ("fake_kernels.kernels", "launched", 17),
        ("fake_kernels.kernels", "forgotten", 23),
    ]


def test_coverage_follows_calls_and_names_the_forgotten_kernel(kernel_package: Path) -> None:
    import fake_kernels.kernels as kernels

    missing = uncovered_jit_functions([kernels.launched], kernel_package)
    where = kernel_package / "kernels.py"
    assert missing == [f"fake_kernels.kernels.forgotten ({where}:23) is launched by no declared scenario"]
    assert len(uncovered_jit_functions([kernels.launched, kernels.forgotten], kernel_package)) == 0


def test_the_engine_package_has_the_jit_functions_the_compile_test_expects() -> None:
    names = sorted(ref.name for ref in find_jit_functions())
    assert names == [
        "_accumulate",
        "_activation_tile",
        "_decode_reduce_kernel",
        "_decode_split_kernel",
        "_finish",
        "_fold",
        "_fp8_gemm_kernel",
        "_gemv_kernel",
        "_gemv_qkv_rope_kernel",
        "_gemv_residual_kernel",
        "_gemv_silu_kernel",
        "_merge_splits",
        "_moe_down_kernel",
        "_moe_gate_up_kernel",
        "_multi_query_split_kernel",
        "_norm_scale",
        "_normed_pair",
        "_plain_product",
        "_prefill_kernel",
        "_product",
        "_quantize_rows_kernel",
        "_rms_norm_kernel",
        "_rotary_cache_kernel",
        "_silu_mul_kernel",
        "_sum_squares_kernel",
        "_tile_pairs",
        "_to_fp8",
        "_token_mask",
        "_weight_tiles",
        "attend_paged_keys",
        "await_producer",
        "round_to_fp8_grid",
        "split_k_program",
        "store_attention_rows",
    ]


def test_verify_cases_are_the_query_lengths_the_runner_captures() -> None:
    assert CASE_VERIFY_QUERY_LENS == tuple(sorted(set(verify_query_lens(3)) | set(verify_query_lens(16))))


def test_fp8_cases_take_each_targets_format() -> None:
    """e4m3fnuz on MI300X (CDNA3), OCP e4m3fn on MI355X and H100; none on MI250X and A100."""
    formats = {name: target.fp8_dtype for name, target in TARGETS_BY_NAME.items()}
    assert formats == {
        "gfx942": "float8_e4m3fnuz",
        "gfx950": "float8_e4m3fn",
        "gfx90a": None,
        "sm_90": "float8_e4m3fn",
        "sm_80": None,
    }
    cases = list(kernel_registry.engine_cases(CUDA, torch.float8_e4m3fnuz, ("bfloat16", "fp8")))
    assert [(c.model.name, c.dtype) for c in cases] == [
        ("smollm2-135m", torch.bfloat16),
        ("smollm2-135m", torch.float8_e4m3fnuz),
        ("llama-3.1-70b", torch.bfloat16),
        ("llama-3.1-70b", torch.float8_e4m3fnuz),
    ]
    assert [c.case_dtype for c in kernel_registry.engine_cases(CUDA, None, ("float16", "fp8"))] == [
        "float16",
        "float16",
    ]


def test_kv_caches_add_an_fp8_cache_to_16_bit_cases_on_fp8_targets() -> None:
    """The attention and rotary scenarios launch for every cache the engine pairs with a case's
    activations: the FP8 one (``--kv-cache-dtype fp8``) with its [2] (K, V) scales."""

    def caches(
        case_dtype: kernel_registry.CaseDtype, fp8: torch.dtype | None
    ) -> list[tuple[torch.dtype, tuple[tuple[int, ...], torch.dtype] | None]]:
        case = kernel_registry.KernelCase(kernel_registry.MODEL_SHAPES[0], case_dtype, fp8, 16, 8192, CUDA)
        return [
            (cache.dtype, None if scale is None else (tuple(scale.shape), scale.dtype))
            for cache, scale in case.kv_caches()
        ]

    assert caches("bfloat16", torch.float8_e4m3fnuz) == [
        (torch.bfloat16, None),
        (torch.float8_e4m3fnuz, ((2,), torch.float32)),
    ]
    assert caches("float16", torch.float8_e4m3fn) == [
        (torch.float16, None),
        (torch.float8_e4m3fn, ((2,), torch.float32)),
    ]
    assert caches("float32", torch.float8_e4m3fn) == [(torch.float32, None)]
    assert caches("bfloat16", None) == [(torch.bfloat16, None)]
    model = kernel_registry.MODEL_SHAPES[0]
    case = kernel_registry.KernelCase(model, "bfloat16", torch.float8_e4m3fn, 16, 8192, CUDA)
    cache, _ = case.kv_caches()[1]
    assert tuple(cache.shape) == (2, 4, 16, model.num_kv_heads, model.head_dim)


@pytest.mark.parametrize(
    ("target", "warps", "registers", "shared", "sgprs", "expected"),
    [
        # MI300X, 8 waves, 120 VGPRs (4 waves/SIMD by registers), the CU's whole 64 KiB of LDS:
        # one workgroup per CU, 2 waves per SIMD.
        ("gfx942", 8, 120, 65536, 89, (1, 2.0, 0.25, "shared", 4)),
        # Same kernel on MI355X: 160 KiB of LDS hold two workgroups; registers then cap at 2.
        ("gfx950", 8, 120, 65536, 89, (2, 4.0, 0.5, "registers", 4)),
        # 4 waves, 24 VGPRs: the wave slots (8 per SIMD) are the limit.
        ("gfx942", 4, 24, 2048, 20, (8, 8.0, 1.0, "waves", 8)),
        # SGPRs over 100 allow 7 waves per SIMD on CDNA even with few VGPRs.
        ("gfx90a", 4, 32, 0, 104, (7, 7.0, 0.875, "sgprs", 7)),
        # One-wave workgroups: 40 per CU at most.
        ("gfx942", 1, 16, 0, 20, (32, 8.0, 1.0, "waves", 8)),
        # H200, 8 warps of 73 registers (80 allocated: 2560 per warp, 6 warps per sub-partition).
        ("sm_90", 8, 73, 39168, 0, (3, 6.0, 0.375, "registers", 6)),
        # A100, 4 warps of 255 registers and 98 KiB of shared memory: one block.
        ("sm_80", 4, 255, 100352, 0, (1, 1.0, 0.0625, "shared", 2)),
    ],
)
def test_occupancy(
    target: str,
    warps: int,
    registers: int,
    shared: int,
    sgprs: int,
    expected: tuple[int, float, float, str, int],
) -> None:
    result = occupancy(TARGETS_BY_NAME[target], warps, registers, shared, sgprs)
    assert (
        result.programs,
        result.waves_per_simd,
        result.fraction,
        result.limiter,
        result.waves_by_registers,
    ) == (expected)


@pytest.mark.parametrize(
    ("hip", "gcn_arch_name", "capability", "arch", "table"),
    [
        ("6.4.43482", "gfx942:sramecc+:xnack-", (9, 4), "gfx942", "rocm"),
        ("7.0.1", "gfx950:sramecc+:xnack-", (9, 5), "gfx950", "rocm"),
        ("6.2.41133", "gfx90a:sramecc+:xnack-", (9, 0), "gfx90a", "rocm"),
        ("6.4.43482", "gfx1100", (11, 0), "gfx1100", "rocm"),
        (None, "", (9, 0), "sm_90", "cuda"),
        (None, "", (8, 0), "sm_80", "cuda-sm80"),
        (None, "", (8, 9), "sm_89", "cuda"),
    ],
)
def test_each_device_gets_its_backends_table(
    hip: str | None, gcn_arch_name: str, capability: tuple[int, int], arch: str, table: str
) -> None:
    assert arch_from_properties(hip, gcn_arch_name, *capability) == arch
    assert table_for_arch(arch) is LAUNCH_TABLES[table]


def test_every_table_entry_has_a_reason() -> None:
    for table in LAUNCH_TABLES.values():
        for name, launch in vars(table).items():
            if name != "name":
                assert launch.reason.strip(), (table.name, name)


def test_the_a100_table_differs_from_the_h200s_in_one_entry() -> None:
    a100 = LAUNCH_TABLES["cuda-sm80"]
    differing = [name for name in vars(CUDA) if name != "name" and getattr(CUDA, name) != getattr(a100, name)]
    assert differing == ["verify_unsplit"]
    assert (a100.verify_unsplit.num_warps, a100.verify_unsplit.num_stages) == (8, 2)


def test_nvidia_entries_are_the_h200_tuned_values() -> None:
    """The values measured on the H200 (bench.gpu_tune) before the table existed."""
    entries = {
        name: (e.num_warps, e.num_stages, e.block_n, e.block_m)
        for name, e in vars(CUDA).items()
        if name != "name"
    }
    assert entries == {
        "decode_unsplit": (2, 2, 64, None),
        "decode_split": (8, 4, 64, None),
        "split_reduce": (4, 3, None, None),
        "verify_unsplit": (4, 2, 64, 64),
        "verify_split": (8, 3, 64, 64),
        "prefill_small_head": (4, 2, 64, None),
        "prefill_large_head": (4, 2, 32, None),
        "rms_norm": (4, 3, None, None),
        "rotary": (4, 3, None, None),
        "silu": (4, 3, 1024, None),
        "moe": (4, 3, None, None),  # Triton's defaults, the session-1 kernel's values (not tuned)
    }


def test_scenarios_declare_kernels_the_package_defines() -> None:
    kernel_registry.import_kernel_modules()
    defined = {ref.name for ref in find_jit_functions()}
    declared = {kernel for decl in kernel_registry.scenarios() for kernel in decl.kernels}
    assert declared <= defined
    assert {decl.name for decl in kernel_registry.scenarios()} == {
        "_decode_launches",
        "_decode_product_launches",
        "_prefill_launches",
        "_verify_launches",
        "_rms_norm_launches",
        "_rotary_launches",
        "_silu_launches",
        "_moe_launches",
        "_fp8_gemm_launches",
        "_fp8_decode_product_launches",
    }


def test_the_docs_launch_table_is_the_codes() -> None:
    """docs/amd.md's launch tables are rendered from LAUNCH_TABLES (python -m bench.amd_compile
    --write-docs), and its compile results name every kernel on every target."""
    from bench import amd_compile

    page = amd_compile.DOCS_PAGE.read_text()
    assert amd_compile.replace_block(page, "launch-table", amd_compile.render_launch_table()) == page, (
        "docs/amd.md's launch table is stale: run python -m bench.amd_compile --write-docs"
    )
    results = page.split("<!-- compile-results:start -->\n", 1)[1].split("\n<!-- compile-results:end -->", 1)[
        0
    ]
    lines = results.splitlines()
    header = " | ".join(f"{t.name} (of {t.max_waves_per_simd})" for t in TARGETS_BY_NAME.values())
    assert lines[0] == f"| kernel | launches | {header} |"
    kernels = sorted(ref.name for ref in find_jit_functions() if ref.name.endswith("_kernel"))
    assert [line.split(" | ")[0] for line in lines[2:]] == [f"| `{name}`" for name in kernels]


def test_launch_counts_are_tabled_per_kernel_module_and_target_in_target_order() -> None:
    from bench import amd_compile

    counts = amd_compile.launch_counts(
        [
            ("sm_80", "baton_engine.model.kernels.triton_gemv"),
            ("gfx942", "baton_engine.model.kernels.triton_fp8"),
            ("gfx942", "baton_engine.model.kernels.triton_gemv"),
            ("gfx942", "baton_engine.model.kernels.triton_gemv"),
        ]
    )
    assert counts == {"sm_80": {"triton_gemv": 1}, "gfx942": {"triton_fp8": 1, "triton_gemv": 2}}
    assert amd_compile.render_launch_counts(counts) == (
        "| kernel module | gfx942 | sm_80 |\n"
        "|---|---|---|\n"
        "| `triton_fp8` | 1 | 0 |\n"
        "| `triton_gemv` | 2 | 1 |\n"
        "| all (4) | 3 | 1 |"
    )


def test_a_spill_fails_a_served_dtype_and_an_lds_overflow_every_dtype() -> None:
    from baton_engine.model.kernels.kernel_compile import KernelReport

    def report(dtype: str, spills: int, shared: int, error: str | None = None) -> KernelReport:
        return KernelReport(
            "_k", "m", "gfx942", [f"smollm2-135m/{dtype}/bs16 _s"], dtype, {}, 4, 1,
            spills=spills, scratch_bytes=8 * spills, shared_bytes=shared, error=error,
        )  # fmt: skip

    gfx942 = TARGETS_BY_NAME["gfx942"]
    assert report("bfloat16", 3, 1024).failure(gfx942) == "3 registers spilled (24 scratch bytes)"
    assert report("fp8", 1, 0).failure(gfx942) == "1 registers spilled (8 scratch bytes)"
    assert report("float32", 3, 1024).failure(gfx942) is None
    assert report("float32", 0, 65537).failure(gfx942) == (
        "65537 B of shared memory, over the 65536 B one program may use"
    )
    assert report("float32", 0, 65536).failure(gfx942) is None
    assert report("float32", 0, 65537).failure(TARGETS_BY_NAME["gfx950"]) is None
    assert (
        report("float16", 0, 0, "CompilationError: boom").failure(gfx942)
        == "compile error: CompilationError: boom"
    )
