"""The metric series the chart's Grafana dashboard queries, read from its JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "charts" / "baton" / "dashboards" / "baton-overview.json"

_SERIES = re.compile(r"\b(baton_[a-z0-9_]+)")


def load() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def expressions(doc: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and template variable queries."""
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in doc["templating"]["list"] if v.get("type") == "query"]
    return exprs


def queried_series(doc: dict[str, Any]) -> set[str]:
    return {name for expr in expressions(doc) for name in _SERIES.findall(expr)}


def family_of(series: str) -> tuple[str, str]:
    """(metric family name as prometheus_client's parser reports it, its type) of a series name."""
    for suffix in ("_bucket", "_sum", "_count"):
        if series.endswith(suffix):
            return series.removesuffix(suffix), "histogram"
    if series.endswith("_total"):
        return series.removesuffix("_total"), "counter"
    return series, "gauge"
