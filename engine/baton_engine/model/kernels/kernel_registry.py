"""The engine's Triton kernels and the launches they are compiled for, declared where they live.

Every module that defines a ``@triton.jit`` kernel declares, next to its launcher, how the engine
launches it: a *scenario* function decorated with `launch_scenario`, called once per
`KernelCase` (a model shape, an activation dtype, a KV block size, a launch table) and calling the
module's real launcher on small CPU tensors shaped like the engine's. `kernel_compile` runs the
scenarios with Triton's launches captured instead of executed, and compiles what was captured for
each GPU target; its coverage check fails when a ``@triton.jit`` function of the package is
neither launched by a scenario nor called by a launched kernel, so a new kernel cannot go
unchecked.

`find_jit_functions` finds the kernels from the source (an AST scan for the decorator), so the
registry follows the package wherever its modules move.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from baton_engine.model.kernels.launch_table import LaunchTable

#: Activation (and KV-cache) dtypes of the cases. "fp8" is a target's FP8 format
#: (`KernelCase.dtype` resolves it), for kernels that take FP8 operands.
CaseDtype = Literal["bfloat16", "float16", "float32", "fp8"]


@dataclass(frozen=True)
class ModelShape:
    """The hyper-parameters of a model that shape its kernels' launches."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.num_heads // self.num_kv_heads


#: The two ends of the shapes the engine runs, which between them give every tile the kernels
#: build: head dim 64 with a group of 3 and a 576-wide hidden state (the default model), and head
#: dim 128 with a group of 8 and an 8192-wide one (the largest verify, norm and rotary tiles).
#: A shape in between (Llama 3.1 8B: head dim 128, group 4) builds a subset of the second's tiles.
MODEL_SHAPES: tuple[ModelShape, ...] = (
    ModelShape(
        "smollm2-135m", num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576, intermediate_size=1536
    ),
    ModelShape(
        "llama-3.1-70b", num_heads=64, num_kv_heads=8, head_dim=128, hidden_size=8192, intermediate_size=28672
    ),
)

#: The engine's default KV block size (EngineConfig.block_size).
DEFAULT_BLOCK_SIZE = 16
#: The context every case is sized for (block tables, split counts): the default model's limit.
CASE_MAX_MODEL_LEN = 8192
#: Query lengths of the verify graphs the GPU runner captures for K = 3 and for the engine's
#: maximum K = 16 drafts (`verify_query_lens(3)` and `verify_query_lens(16)`, ascending).
CASE_VERIFY_QUERY_LENS = (2, 3, 4, 5, 9, 17)


@dataclass(frozen=True)
class KernelCase:
    """One engine configuration a scenario launches its kernels for."""

    model: ModelShape
    case_dtype: CaseDtype
    #: The target's FP8 format (None: the target has no FP8); what "fp8" resolves to.
    fp8_dtype: torch.dtype | None
    block_size: int
    max_model_len: int
    #: The launch parameters of the backend the kernels are compiled for.
    launch: LaunchTable

    @property
    def dtype(self) -> torch.dtype:
        if self.case_dtype == "fp8":
            if self.fp8_dtype is None:
                raise ValueError("this case's target has no FP8 format")
            return self.fp8_dtype
        dtype: torch.dtype = getattr(torch, self.case_dtype)
        return dtype

    @property
    def max_blocks(self) -> int:
        """Block-table columns for `max_model_len` tokens."""
        return -(-self.max_model_len // self.block_size)

    def label(self) -> str:
        return f"{self.model.name}/{self.case_dtype}/bs{self.block_size}"

    def kv_cache(self, num_blocks: int = 4) -> torch.Tensor:
        """One layer's paged cache, [2, num_blocks, block_size, kv_heads, head_dim]."""
        shape = (2, num_blocks, self.block_size, self.model.num_kv_heads, self.model.head_dim)
        return torch.zeros(shape, dtype=self.dtype)

    def kv_caches(self, num_blocks: int = 4) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The layer caches the engine pairs with this case's activations, each with its (K, V)
        scales: one in the activation dtype (scales None) and, for 16-bit activations on a target
        with FP8, one in the target's FP8 format (``--kv-cache-dtype fp8``, [2] float32 scales)."""
        caches: list[tuple[torch.Tensor, torch.Tensor | None]] = [(self.kv_cache(num_blocks), None)]
        if self.fp8_dtype is not None and self.case_dtype in ("bfloat16", "float16"):
            fp8_case = dataclasses.replace(self, case_dtype="fp8")
            caches.append((fp8_case.kv_cache(num_blocks), torch.ones(2, dtype=torch.float32)))
        return caches

    def qkv(self, tokens: int) -> torch.Tensor:
        """The fused qkv projection's output, [tokens, (H + 2 * KVH) * D]: q is a view of it."""
        m = self.model
        return torch.zeros(tokens, (m.num_heads + 2 * m.num_kv_heads) * m.head_dim, dtype=self.dtype)

    def q(self, tokens: int) -> torch.Tensor:
        """The attention query as the decoder passes it: a [tokens, H, D] view of `qkv`."""
        m = self.model
        return self.qkv(tokens)[:, : m.num_heads * m.head_dim].view(tokens, m.num_heads, m.head_dim)

    def block_tables(self, rows: int) -> torch.Tensor:
        return torch.zeros(rows, self.max_blocks, dtype=torch.int32)


#: A scenario: calls its module's launchers for one case.
Scenario = Callable[[KernelCase], None]


@dataclass(frozen=True)
class ScenarioDecl:
    """A declared scenario: the kernels it must launch (by function name) and the dtypes it runs."""

    module: str
    name: str
    kernels: tuple[str, ...]
    dtypes: tuple[CaseDtype, ...]
    run: Scenario


_SCENARIOS: dict[tuple[str, str], ScenarioDecl] = {}


def launch_scenario(
    *kernels: str, dtypes: tuple[CaseDtype, ...] = ("bfloat16", "float16", "float32")
) -> Callable[[Scenario], Scenario]:
    """Declare a scenario that launches `kernels` (names of ``@triton.jit`` functions) per case.

    `dtypes` lists the activation dtypes the engine runs the kernels with; a kernel that takes
    FP8 adds "fp8", compiled in each target's format and skipped on targets without FP8.
    """

    def register(run: Scenario) -> Scenario:
        decl = ScenarioDecl(run.__module__, run.__qualname__, kernels, dtypes, run)
        _SCENARIOS[(decl.module, decl.name)] = decl
        return run

    return register


def scenarios() -> list[ScenarioDecl]:
    """Every declared scenario of the imported kernel modules (`import_kernel_modules` first)."""
    return sorted(_SCENARIOS.values(), key=lambda d: (d.module, d.name))


def engine_cases(
    launch: LaunchTable, fp8_dtype: torch.dtype | None, dtypes: tuple[CaseDtype, ...]
) -> Iterator[KernelCase]:
    """The cases a scenario runs for one target: every model shape in each of its dtypes."""
    for model in MODEL_SHAPES:
        for case_dtype in dtypes:
            if case_dtype == "fp8" and fp8_dtype is None:
                continue
            yield KernelCase(model, case_dtype, fp8_dtype, DEFAULT_BLOCK_SIZE, CASE_MAX_MODEL_LEN, launch)


@dataclass(frozen=True)
class JitFunctionRef:
    """A ``@triton.jit`` function found in the source."""

    module: str
    name: str
    path: str
    line: int

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


def _is_triton_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (
        isinstance(target, ast.Attribute)
        and target.attr == "jit"
        and (isinstance(target.value, ast.Name) and target.value.id == "triton")
    )


def package_root() -> Path:
    """The `baton_engine` package directory."""
    return Path(importlib.import_module("baton_engine").__file__ or "").parent


def find_jit_functions(root: Path | None = None) -> list[JitFunctionRef]:
    """Every function decorated ``@triton.jit`` (or ``@triton.jit(...)``) under the package."""
    root = package_root() if root is None else root
    found: list[JitFunctionRef] = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if "triton.jit" not in text:
            continue
        relative = path.relative_to(root.parent).with_suffix("")
        parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
        module = ".".join(parts)
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.FunctionDef) and any(_is_triton_jit(d) for d in node.decorator_list):
                found.append(JitFunctionRef(module, node.name, str(path), node.lineno))
    return found


def import_kernel_modules(root: Path | None = None) -> list[str]:
    """Import every module that defines a ``@triton.jit`` function (registering its scenarios)."""
    modules = sorted({ref.module for ref in find_jit_functions(root)})
    for module in modules:
        importlib.import_module(module)
    return modules
