"""The docs say what the code does: every shell block of the README and the docs pages is run by
a named test, the reference pages are generated from the code and current, the troubleshooting
page covers every reason the operator writes, every Markdown file's code fences balance, and the
plots come from the recorded figures."""

from __future__ import annotations

import ast
import json
import re
import subprocess
from pathlib import Path

import pytest

from baton_engine import contract
from baton_operator import crd_reference
from baton_support import metrics_reference
from bench import plots
from tests.demo.readme import DOCS, README, REPO, marked_blocks, shell_blocks

PAGES = [README, *sorted(DOCS.rglob("*.md"))]


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def tracked_markdown() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True, check=True)
    return [REPO / line for line in out.stdout.split()]


def unbalanced_fences(text: str) -> list[int]:
    """Line numbers of fences left open (a fence opens with ``` or ~~~ and closes with the same
    run of at least its length). An opening fence of the same run met inside an open one (its
    info string says it opens) means the one before it lost its closing line: both are reported,
    since Markdown would pair them wrongly from there on."""
    open_at: tuple[int, str] | None = None
    unclosed: list[int] = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        marker = stripped[:3]
        if marker not in ("```", "~~~"):
            continue
        run = stripped[: len(stripped) - len(stripped.lstrip(marker[0]))]
        info = stripped[len(run) :].strip()
        if open_at is None:
            open_at = (number, run)
        elif run.startswith(open_at[1]) and not info:
            open_at = None
        elif run == open_at[1]:
            unclosed.append(open_at[0])
            open_at = (number, run)
    return unclosed if open_at is None else [*unclosed, open_at[0]]


def test_unbalanced_fences_are_found() -> None:
    assert unbalanced_fences("a\n```json\n{}\n```\n") == []
    assert unbalanced_fences("```json\n{}\n\n## next\n") == [1]
    assert unbalanced_fences("````md\n```sh\nx\n```\n````\n") == []
    assert unbalanced_fences("```json\n{}\n\ntext\n```json\n{}\n```\n") == [1]
    assert unbalanced_fences("```sh\nx\n```json\n") == [1, 3]


@pytest.mark.parametrize("path", tracked_markdown(), ids=rel)
def test_code_fences_balance(path: Path) -> None:
    assert unbalanced_fences(path.read_text()) == [], f"{rel(path)}: a code fence is never closed"


def _test_exists(test_id: str) -> Path:
    path, name = test_id.split("::")
    module = REPO / path
    assert module.is_file(), f"{test_id}: no such file"
    tree = ast.parse(module.read_text())
    functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    assert name in functions, f"{test_id}: no such test"
    return module


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_shell_block_is_run_by_a_named_test(page: Path) -> None:
    """Each shell block carries ``<!-- tested: path::test, ... -->``; each named test exists and
    reads this page (it names the page, or is the README's demo test reading the README)."""
    text = page.read_text()
    marked = marked_blocks(text)
    assert [b.commands for b in marked] == shell_blocks(text), (
        f"{rel(page)}: every shell block needs a '<!-- tested: tests/...::test_name -->' line above it"
    )
    for block in marked:
        for test_id in block.tests:
            if test_id == "ci":  # the CI job is `make test` itself
                assert block.commands.count("make test") == 1
                assert "make test" in (REPO / ".ci" / "run").read_text()
                continue
            source = _test_exists(test_id).read_text()
            names_page = rel(page) in source or f'"{page.name}"' in source
            reads_readme = page == README and "block_after(" in source
            assert names_page or reads_readme, f"{rel(page)}: {test_id} does not read this page"


def test_metrics_reference_is_generated_and_current() -> None:
    assert metrics_reference.main(["--check"]) == 0, "run python -m baton_support.metrics_reference"
    engine = {r.name: r for r in metrics_reference.engine_rows()}
    contract_names = {
        v for k, v in vars(contract).items() if k.startswith("M_") and not k.startswith("M_ROUTER_")
    }
    assert sorted(engine) == sorted(contract_names)
    router = {r.name for r in metrics_reference.router_rows()}
    assert router == {v for k, v in vars(contract).items() if k.startswith("M_ROUTER_")}
    operator = metrics_reference.operator_rows()
    assert {r.name.split("_")[1] for r in operator} == {"operator", "autoscaler"}
    every = [*engine.values(), *metrics_reference.router_rows(), *operator]
    assert {r.kind for r in every} == {"gauge", "counter", "histogram"}
    for row in every:
        assert row.name.startswith("baton_") and row.help, row
        assert (row.kind == "counter") == row.name.endswith("_total"), row.name
    page = metrics_reference.PAGE.read_text()
    assert "| `baton_kv_cache_usage_ratio` | gauge | `model_name` |" in page
    assert f"`{contract.VLLM_EQUIVALENT[contract.M_KV_USAGE]}` |" in page


def test_crd_reference_is_generated_and_current() -> None:
    page = REPO / "docs/reference/inferencedeployment.md"
    text = page.read_text()
    assert crd_reference.replace_block(text, crd_reference.render()) == text, (
        "docs/reference/inferencedeployment.md is stale: run python -m baton_operator.crd_reference"
    )
    assert crd_reference.main(["--check"]) == 0  # its default page is this one
    assert "| `spec.model.source` | string |" in text


def _reason_constants(trees: list[ast.Module]) -> dict[str, set[str]]:
    """Module-level names bound to reason strings: ``X = "A"``, ``X, Y = "A", "B"``,
    ``X = frozenset({X, Y})`` and dicts of them (their values)."""
    consts: dict[str, set[str]] = {}

    def values(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.Name):
            return consts.get(node.id, set())
        if isinstance(node, ast.Set | ast.Tuple | ast.List):
            return set().union(*(values(e) for e in node.elts)) if node.elts else set()
        if isinstance(node, ast.Dict):
            return set().union(*(values(v) for v in node.values)) if node.values else set()
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("frozenset", "set")
        ):
            return values(node.args[0]) if node.args else set()
        return set()

    for _ in range(2):  # a second pass resolves names defined in modules read later
        for tree in trees:
            for node in tree.body:
                if not isinstance(node, ast.Assign):
                    continue
                target = node.targets[0]
                if isinstance(target, ast.Name):
                    consts[target.id] = values(node.value)
                elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    for name, value in zip(target.elts, node.value.elts, strict=True):
                        if isinstance(name, ast.Name):
                            consts[name.id] = values(value)
    return consts


def operator_reasons() -> tuple[set[str], set[str]]:
    """(condition reasons, Event reasons) the operator's code writes: the third argument of
    resource_status._condition, the second of ``Event(type, reason, message)``, every ``reason=`` keyword,
    and the autoscaler's EVENT_REASONS. A reconcile failure's reason (``failure.reason``) is a
    condition reason when the status records it (one of FAILURE_REASONS) and an Event reason for
    every ``Failure(reason, ...)`` the code builds."""
    trees = [ast.parse(p.read_text()) for p in sorted((REPO / "operator" / "baton_operator").rglob("*.py"))]
    consts = _reason_constants(trees)
    failures = {"condition": consts["FAILURE_REASONS"], "event": set[str]()}

    def resolve(node: ast.AST, where: str) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.Name):
            return consts.get(node.id, set())
        if isinstance(node, ast.Attribute) and node.attr == "reason":
            if isinstance(node.value, ast.Name) and node.value.id == "failure":
                return failures[where]
            if isinstance(node.value, ast.Name):  # `stuck.reason`: one of STUCK_REASONS
                return consts.get(f"{node.value.id.upper()}_REASONS", set())
        return set()

    calls = [
        (node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", ""), node)
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
    ]
    for func, call in calls:
        if func == "Failure" and call.args:
            failures["event"] |= resolve(call.args[0], "event")

    conditions: set[str] = set()
    events: set[str] = set(consts.get("EVENT_REASONS", set()))
    for func, call in calls:
        if func == "_condition" and len(call.args) >= 3:
            conditions |= resolve(call.args[2], "condition")
        elif func == "Event" and len(call.args) >= 2:
            events |= resolve(call.args[1], "event")
        for kw in call.keywords:
            if kw.arg == "reason":
                events |= resolve(kw.value, "event")
    return conditions, events


def _headings(text: str, section: str) -> set[str]:
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return {line.removeprefix("### ").strip() for line in body.splitlines() if line.startswith("### ")}


def test_troubleshooting_covers_every_reason_the_operator_writes() -> None:
    conditions, events = operator_reasons()
    assert {"AllPodsReady", "PodsNotReady", "ReconcileFailed", "ChildRefused"} <= conditions
    assert {"ScaledUp", "ScaledDown", "ScaleFailed", "ChildRefused", "InvalidSpec", "Reconciled"} <= events
    text = (DOCS / "troubleshooting.md").read_text()
    assert _headings(text, "Conditions") == conditions
    assert _headings(text, "Events") == events


def test_plots_are_drawn_from_the_recorded_figures(tmp_path: Path) -> None:
    summary = plots.draw(tmp_path)
    assert sorted(summary) == sorted(plots.PLOTS)
    for name, drawn in summary.items():
        png = tmp_path / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert drawn["records"] > 0, f"{name}: no recorded figure found"
        assert (DOCS / "img" / png.name).is_file(), f"docs/img/{png.name} not committed"
        assert f"(img/{png.name})" in (DOCS / "benchmarks.md").read_text()
    assert sorted(p.stem for p in (DOCS / "img").glob("*.png")) == sorted(plots.PLOTS)


def test_plots_read_the_shapes_they_document(tmp_path: Path) -> None:
    """The records' benchmark, the current record, quick runs skipped; a future batch sweep."""
    history, results = tmp_path / "history.md", tmp_path / "RESULTS.md"
    old = '{"us_per_seq_step": {"64": 2.0}, "cpu_us_per_seq_step": {"64": 1.0, "1024": 0.5}}'
    new = '{"bench": "scheduler", "quick": false, "cpu_us_per_seq_step": {"64": 0.9, "1024": 0.4}}'
    quick = '{"bench": "scheduler", "quick": true, "cpu_us_per_seq_step": {"16": 9.0}}'
    sweep = (
        '{"bench": "gpu", "gpu": "X", "step_ms_by_batch_8b": {"1": 5.0, "64": 6.0},'
        ' "limit_ms_by_batch_8b": {"1": 4.6, "64": 5.1}}'
    )
    history.write_text(f"```json\n{old}\n{new}\n{quick}\n```\n")
    results.write_text(f"```json\n{new}\n{sweep}\n```\n")
    records = plots.load_records([history, results])
    assert [r["cpu_us_per_seq_step"]["64"] for r in records["scheduler"]] == [1.0, 0.9]
    assert plots.latest(records["scheduler"])["cpu_us_per_seq_step"]["1024"] == 0.4
    assert [r[plots.CURRENT] for r in records["scheduler"]] == [False, True]
    summary = plots.draw(tmp_path / "out", [history, results])
    assert summary["gpu_step_vs_limit"] == {"records": 1, "missing": []}
    assert summary["scheduler_cost"] == {"records": 2, "missing": []}
    assert summary["kv_transfer_vs_tcp"] == {"records": 0, "missing": ["bench.kv_transfer runs"]}


def test_recorded_results_are_json_of_existing_benchmarks() -> None:
    """bench/RESULTS.md: every section and every command of the figures table names a benchmark
    that exists, and every recorded line (also in the history) is one JSON object."""
    from tests.bench.test_quick import BENCHMARKS

    results = (REPO / "bench" / "RESULTS.md").read_text()
    sections = [line.removeprefix("## bench.") for line in results.splitlines() if line.startswith("## ")]
    assert sections and set(sections) <= set(BENCHMARKS), sections
    table = results.split("<!-- --8<-- [start:current] -->", 1)[1].split("<!-- --8<-- [end:current] -->")[0]
    commands = re.findall(r"`python -m bench\.(\w+)[^`]*`", table)
    assert commands and set(commands) <= set(BENCHMARKS), commands
    for path in [REPO / "bench" / "RESULTS.md", *sorted((REPO / "bench" / "history").glob("*.md"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("{"):
                assert isinstance(json.loads(line), dict), f"{rel(path)}:{number}"
