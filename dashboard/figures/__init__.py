"""Plotly figures for the dashboard: pure functions, DataFrame in, `go.Figure` out.

Inputs use the store's units (seconds, tokens); latencies are drawn in milliseconds and every
axis title carries its unit. Colours are fixed per serving mode and per reuse outcome so the same
thing looks the same on every chart. An empty input gives an empty figure that says so.

One module per page (`overview`, `turns`, `sessions`, `memory`, `compare`; the Sweep page's are
``dashboard.sweep_figures``) and their shared `common` parts; every figure is re-exported here.
"""

from __future__ import annotations

from dashboard.figures.common import (
    MODE_COLORS,
    MODE_ORDER,
    OUTCOME_COLORS,
    OUTCOME_ORDER,
    OUTCOME_SYMBOLS,
    empty_figure,
    legend_below,
    ordered_present,
    run_colors,
    turn_axis,
)
from dashboard.figures.compare import CASE_COLORS, compare_by_turn, compare_cases
from dashboard.figures.memory import (
    NIXL_FAILURE_BARS,
    ROLE_DASHES,
    memory_timeline,
    nixl_failures,
    whatif_ttl,
)
from dashboard.figures.overview import external_kv_tokens, reuse_outcomes, ttft_by_turn
from dashboard.figures.sessions import GAP_COLORS, TASK_PARTS, session_timeline, task_split
from dashboard.figures.turns import (
    EXPECTED_APART,
    LATENCY_METRICS,
    TIME_PARTS,
    latency_panels,
    reuse_vs_expected,
    time_split,
)

__all__ = ["CASE_COLORS", "EXPECTED_APART", "GAP_COLORS", "LATENCY_METRICS", "MODE_COLORS", "MODE_ORDER", "NIXL_FAILURE_BARS", "OUTCOME_COLORS", "OUTCOME_ORDER", "OUTCOME_SYMBOLS", "ROLE_DASHES", "TASK_PARTS", "TIME_PARTS", "compare_by_turn", "compare_cases", "empty_figure", "external_kv_tokens", "latency_panels", "legend_below", "memory_timeline", "nixl_failures", "ordered_present", "reuse_outcomes", "reuse_vs_expected", "run_colors", "session_timeline", "task_split", "time_split", "ttft_by_turn", "turn_axis", "whatif_ttl"]
