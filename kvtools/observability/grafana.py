"""The dashboards of ``dashboards.py`` as Grafana dashboard JSON, built with Grafana's own
grafana-foundation-sdk (the ``observability`` extra): its builders write the schema, we only say
what is on each board.

Every panel reads the Prometheus data source chosen in the board's ``datasource`` variable; boards
link to each other by their ``kvindex`` tag. Output is deterministic (sorted keys, ids and query
refs numbered in order), so the committed JSON can be compared with a fresh generation.
"""

from __future__ import annotations

import json
import string
from typing import Any

from grafana_foundation_sdk.builders import common as gc
from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    LegendDisplayMode,
    LegendPlacement,
    SortOrder,
    TooltipDisplayMode,
)
from grafana_foundation_sdk.models.dashboard import DashboardLinkType, DataSourceRef

from kvtools.observability.dashboards import Dashboard, Panel

TAG = "kvindex"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
HEIGHT = 8


def _panel(p: Panel, panel_id: int) -> Any:
    builder: Any
    if p.kind == "stat":  # the last value, with its sparkline
        builder = stat.Panel().reduce_options(gc.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    else:  # every series' legend below, the tooltip listing them all, highest first
        builder = (
            timeseries.Panel()
            .legend(
                gc.VizLegendOptions()
                .display_mode(LegendDisplayMode.LIST)
                .placement(LegendPlacement.BOTTOM)
                .show_legend(True)
            )
            .tooltip(gc.VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING))
        )
    builder = builder.id(panel_id).title(p.title).datasource(DATASOURCE).unit(p.unit).span(p.width)
    builder = builder.height(4 if p.kind == "stat" else HEIGHT)
    if p.description:
        builder = builder.description(p.description)
    for ref, q in zip(string.ascii_uppercase, p.queries, strict=False):
        target = prometheus.Dataquery().expr(q.expr).ref_id(ref).range()
        if q.legend:
            target = target.legend_format(q.legend)
        builder = builder.with_target(target)
    return builder


def build(board: Dashboard) -> Any:
    """The SDK's dashboard model of ``board``."""
    assert all(len(p.queries) <= 26 for r in board.rows for p in r.panels), "one ref per letter"
    d = (
        gd.Dashboard(board.title)
        .uid(board.uid)
        .description(board.description)
        .tags([TAG])
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .with_variable(gd.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .link(gd.DashboardLink("kvindex").type(DashboardLinkType.DASHBOARDS).tags([TAG]).as_dropdown(True))
    )
    panel_id = 0
    for row in board.rows:
        panel_id += 1
        d = d.with_row(gd.Row(row.title).id(panel_id))
        for p in row.panels:
            panel_id += 1
            d = d.with_panel(_panel(p, panel_id))
    return d.build()


def render(board: Dashboard) -> str:
    """Grafana dashboard JSON of ``board``, as committed under deploy/observability/dashboards/."""
    data = json.loads(json.dumps(build(board), cls=JSONEncoder))
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
