"""The README stays true: its generated CRD reference is current, its metrics tables match the
contract, and every command in its shell blocks is run by a named test (or by CI)."""

from __future__ import annotations

import ast
import re

from baton_engine import contract
from baton_operator import crd_reference
from tests.demo.readme import README, REPO, block_after, shell_blocks

DEMO_TEST = "tests/demo/test_demo.py::test_make_demo_then_demo_down"
CLUSTER_TEST = "tests/demo/test_readme_cluster_commands.py::test_readme_real_cluster_commands"
#: README command -> the test that runs it verbatim ("ci": the CI job itself is that command).
RUN_BY = {
    "make demo": DEMO_TEST,
    "make test": "ci",
    'eval "$(.venv/bin/baton-dev cluster env --name demo)"': DEMO_TEST,
    "kubectl get infd -n baton-demo": DEMO_TEST,
    "make demo-down": DEMO_TEST,
    "helm install baton charts/baton -n baton-system --create-namespace": CLUSTER_TEST,
    "kubectl apply -f examples/minimal.yaml": CLUSTER_TEST,
    "kubectl get infd": CLUSTER_TEST,
}


def test_shell_blocks_parse() -> None:
    text = (
        "x\n```sh\nmake a   # note\n# only a comment\n\nfoo \\\n  --bar\n```\n```text\nnot a command\n```\n"
    )
    assert shell_blocks(text) == [["make a", "foo --bar"]]


def test_every_readme_command_is_run_by_a_test() -> None:
    commands = [c for block in shell_blocks() for c in block]
    assert commands == list(RUN_BY)
    assert block_after("## Quick start") == ["make demo", "make test"]
    for command, test_id in RUN_BY.items():
        if test_id == "ci":
            continue
        path, name = test_id.split("::")
        tree = ast.parse((REPO / path).read_text())
        functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in functions, f"{command!r}: {test_id} does not exist"


def test_crd_reference_is_current() -> None:
    text = README.read_text()
    assert crd_reference.replace_block(text, crd_reference.render()) == text, (
        "README's CRD reference is stale: run python -m baton_operator.crd_reference"
    )
    assert crd_reference.main(["--check", "--readme", str(README)]) == 0


def _table_rows(header: str) -> dict[str, list[str]]:
    text = README.read_text()
    start = text.index(header)
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells
    return rows


def test_metrics_reference_matches_the_contract() -> None:
    engine = _table_rows("| engine metric | type | meaning | vLLM equivalent |")
    names = {v for k, v in vars(contract).items() if k.startswith("M_") and not k.startswith("M_ROUTER_")}
    assert sorted(engine) == sorted(names)
    for name, cells in engine.items():
        assert cells[3] == (
            f"`{contract.VLLM_EQUIVALENT[name]}`" if name in contract.VLLM_EQUIVALENT else "—"
        )
    router = _table_rows("| router metric | type | meaning |")
    assert sorted(router) == sorted(v for k, v in vars(contract).items() if k.startswith("M_ROUTER_"))
    kinds = {row[1] for row in [*engine.values(), *router.values()]}
    assert kinds == {"gauge", "counter", "histogram"}
    for name, cells in {**engine, **router}.items():
        assert (cells[1] == "counter") == name.endswith("_total"), name


def test_readme_names_only_existing_paths() -> None:
    text = README.read_text()
    paths = set(
        re.findall(r"`((?:engine|operator|charts|examples|images|devcluster|tests|bench)/[^`* <]+)`", text)
    )
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert missing == []
