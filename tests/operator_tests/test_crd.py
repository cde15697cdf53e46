"""The generated CRD: committed copies are current, and the schema is structural."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from baton_operator import cli, crd, crd_reference
from tests.operator_tests.conftest import REPO


def test_committed_crds_are_generated() -> None:
    expected = crd.render()
    for rel in crd.OUTPUT_PATHS:
        assert (REPO / rel).read_text() == expected, f"{rel} is stale: run `baton-operator crd`"


def _untyped_nodes(node: Any, path: str) -> list[str]:
    if not isinstance(node, dict):
        return []
    bad = []
    if not ({"type", "x-kubernetes-int-or-string"} & node.keys()):
        bad.append(path)
    for name, sub in node.get("properties", {}).items():
        bad += _untyped_nodes(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        bad += _untyped_nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        bad += _untyped_nodes(node["additionalProperties"], f"{path}{{}}")
    return bad


def test_schema_is_structural() -> None:
    schema = crd.openapi_schema()
    text = crd.render()
    assert _untyped_nodes(schema, "") == []
    for forbidden in ("$ref", "$defs", "title:", "type: 'null'", "additionalProperties: false"):
        assert forbidden not in text


def test_names_columns_and_subresources() -> None:
    doc = crd.crd()
    version = doc["spec"]["versions"][0]
    assert doc["metadata"]["name"] == "inferencedeployments.baton.dev"
    assert doc["spec"]["names"]["shortNames"] == ["infd"]
    assert version["name"] == "v1alpha1"
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Model", "Mode", "Prefill", "Decode", "Pool", "Ready", "Endpoint", "Age",
    ]  # fmt: skip
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["autoscaling"]["properties"]["mode"]["enum"] == ["builtin", "external", "off"]
    usage = spec["properties"]["autoscaling"]["properties"]["decode"]["properties"]["targetKVUsage"]
    assert (usage["minimum"], usage["exclusiveMinimum"], usage["maximum"]) == (0.0, True, 1.0)
    memory = spec["properties"]["prefill"]["properties"]["resources"]["properties"]["memory"]
    assert memory["x-kubernetes-int-or-string"] is True
    # Affinity is typed (core/v1 Affinity), not passed through: the API server validates it.
    affinity = spec["properties"]["prefill"]["properties"]["affinity"]
    assert "x-kubernetes-preserve-unknown-fields" not in json.dumps(affinity)
    assert sorted(affinity["properties"]) == ["nodeAffinity", "podAffinity", "podAntiAffinity"]


def test_cli_writes_both_copies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["crd", "--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / rel) for rel in crd.OUTPUT_PATHS]
    for rel in crd.OUTPUT_PATHS:
        assert (tmp_path / rel).read_text() == crd.render()
    assert cli.main(["crd", "--stdout"]) == 0
    assert capsys.readouterr().out == crd.render()


def test_cli_run_refuses_both_scopes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--namespace", "a", "--all-namespaces"])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("node", "shown"),
    [
        ({"minimum": 0.0, "exclusiveMinimum": True, "maximum": 1.0}, "> 0.0, ≤ 1.0"),
        ({"minimum": 1, "maximum": 64, "exclusiveMaximum": True}, "≥ 1, < 64"),
        ({"minimum": 0}, "≥ 0"),
        ({"maxLength": 63, "pattern": "^a$"}, "length ≤ 63, pattern `^a$`"),
    ],
)
def test_the_reference_shows_exclusive_bounds_as_such(node: dict[str, object], shown: str) -> None:
    assert crd_reference._limits(node) == shown


def test_affinity_is_one_row_per_pool() -> None:
    text = crd_reference.render()
    assert "| `spec.prefill.affinity` | object |" in text
    assert "spec.prefill.affinity.nodeAffinity" not in text
