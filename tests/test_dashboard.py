"""``examples/grafana/flatcake.json`` asks only for series the service exports.

Every metric name in every PromQL query (panels and template variables) must be one that
``flatcake_ray.metrics.definitions`` exports, under the names Ray's agent gives it (``ray_``
prefix, ``_total`` counters, ``_bucket``/``_sum``/``_count`` histograms); every label a query
selects on or groups by must be a tag of a metric it reads. And the dashboard shows what the
operator needs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from flatcake_ray.metrics.definitions import METRICS, exported_series

DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "grafana" / "flatcake.json"
NAME = re.compile(r"(?<![A-Za-z0-9_:$])([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\}|\[)")
METRIC_WORD = re.compile(r"(?<![A-Za-z0-9_])((?:ray_)?flatcake_[a-z_]+)")
MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|ignoring|on|without)\s*\(([^)]*)\)")
TAGS_OF = {series: set(m.tags) for m in METRICS for series in m.series()}


def panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(variable["query"]["query"])
    return exprs


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_every_metric_a_query_names_is_exported(dashboard):
    exported = exported_series()
    named = set()
    for expr in queries(dashboard):
        words = set(METRIC_WORD.findall(expr))
        assert words, f"a query reads no FlatCake metric: {expr}"
        named |= words
    unknown = sorted(named - exported)
    assert not unknown, f"not exported by the service: {unknown}"
    assert len(named) >= 15  # the dashboard reads most of what is exported


def test_selected_and_grouped_labels_are_tags_of_the_metrics_read(dashboard):
    for expr in queries(dashboard):
        read = set(METRIC_WORD.findall(expr))
        tags = set().union(*(TAGS_OF[name] for name in read))
        if any(name.endswith("_bucket") for name in read):
            tags.add("le")
        for name, selector in NAME.findall(expr):
            if name in TAGS_OF and selector.startswith("{"):
                assert set(MATCHER.findall(selector)) <= TAGS_OF[name], (name, selector)
        for group in GROUPING.findall(expr):
            labels = {label.strip() for label in group.split(",") if label.strip()}
            assert labels <= tags, (expr, labels - tags)
        variable = re.match(r"label_values\((\w+),\s*(\w+)\)", expr)
        if variable:
            assert variable.group(2) in TAGS_OF[variable.group(1)]


def test_the_dashboard_shows_what_an_operator_needs(dashboard):
    titles = " | ".join(p["title"].lower() for p in panels(dashboard))
    for subject in (
        "hit rate by medium",
        "p50 / p99 by path",
        "gb/s by path",
        "read amplification",
        "reclamation",
        "quarantine",
        "use per tenant",
        "restarts",
    ):
        assert subject in titles, subject
    for panel in panels(dashboard):
        if panel["type"] != "row":
            refs = [t["refId"] for t in panel["targets"]]
            assert refs and len(refs) == len(set(refs)), panel["title"]
            assert panel["datasource"]["uid"] == "${datasource}"
