"""The demo's pure parts: placement on process nodes, chart values, step progress."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from baton_dev.binaries import find_binaries
from baton_dev.demo_manifests import PROCESS_NODES, chart_values, with_node_selector
from baton_dev.demo_steps import DemoFailed, Progress

REPO = Path(__file__).resolve().parents[2]


def test_example_lands_on_process_nodes_without_editing_it() -> None:
    original = yaml.safe_load((REPO / "examples/smollm2-pd.yaml").read_text())
    placed = with_node_selector(original, PROCESS_NODES)
    assert PROCESS_NODES == {"type": "process"}
    for pool in ("prefill", "decode", "router"):
        assert placed["spec"][pool]["nodeSelector"] == {"type": "process"}
        assert "nodeSelector" not in original["spec"][pool]
    assert "pool" not in placed["spec"]
    aggregated = {"spec": {"mode": "aggregated", "pool": {"nodeSelector": {"a": "b"}}}}
    merged = with_node_selector(aggregated, PROCESS_NODES)
    assert merged["spec"] == {
        "mode": "aggregated",
        "pool": {"nodeSelector": {"a": "b", "type": "process"}},
        "router": {"nodeSelector": {"type": "process"}},
    }
    with pytest.raises(ValueError, match="InferenceDeployment without a spec"):
        with_node_selector({"metadata": {}}, PROCESS_NODES)


def test_chart_renders_the_operator_on_process_nodes(tmp_path: Path) -> None:
    values = tmp_path / "values.json"
    values.write_text(json.dumps(chart_values(PROCESS_NODES)))
    helm = find_binaries().path("helm")
    out = subprocess.run(
        [str(helm), "template", "baton", str(REPO / "charts/baton"), "-n", "baton-system", "-f", str(values)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    [deployment] = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment"]
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["template"]["spec"]["nodeSelector"] == {"type": "process"}


def test_progress_numbers_steps_and_logs(tmp_path: Path) -> None:
    out = io.StringIO()
    progress = Progress(total=2, out=out)
    progress.attach_log(tmp_path / "logs" / "demo.log")
    with progress.step("first", logs="/somewhere"):
        pass
    with pytest.raises(DemoFailed), progress.step("second"):
        raise DemoFailed("boom")
    lines = out.getvalue().splitlines()
    assert lines[0] == "[1/2] first  (logs: /somewhere)"
    assert lines[1].startswith("      done in ") and lines[1].endswith(" s")
    assert lines[2] == "[2/2] second"
    assert lines[3].startswith("      FAILED after ")
    assert (tmp_path / "logs" / "demo.log").read_text().count("\n") == 4
