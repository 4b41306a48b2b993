"""dashboard.figures and dashboard.tables: DataFrame in, figure/table out, units as documented."""

from __future__ import annotations

import pandas as pd
import pytest

from dashboard import figures, tables


def test_ttft_by_turn_in_ms_one_panel():
    df = pd.DataFrame(
        {
            "mode": ["aggregated", "aggregated", "pd-bidir", "pd-bidir"],
            "workload": "w",
            "history_mode": "text",
            "turn_index": [0, 1, 0, 1],
            "turns": [3, 3, 3, 3],
            "ttft_p50_s": [0.3, 0.35, 0.32, 0.12],
            "ttft_p90_s": [0.4, 0.45, 0.42, 0.22],
        }
    )
    fig = figures.ttft_by_turn(df)
    traces = {t.name: t for t in fig.data}
    assert set(traces) == {"aggregated, p50", "aggregated, p90", "pd-bidir, p50", "pd-bidir, p90"}
    assert list(traces["pd-bidir, p50"].y) == pytest.approx([320.0, 120.0])
    assert fig.layout.yaxis.title.text == "TTFT (ms)"
    assert traces["aggregated, p50"].line.color == figures.MODE_COLORS["aggregated"]


def test_ttft_by_turn_facets_per_workload():
    df = pd.DataFrame(
        {
            "mode": ["pd-bidir", "pd-bidir"],
            "workload": ["w", "w"],
            "history_mode": ["text", "token_ids"],
            "turn_index": [1, 1],
            "ttft_p50_s": [0.1, 0.2],
            "ttft_p90_s": [0.1, 0.2],
        }
    )
    fig = figures.ttft_by_turn(df)
    assert {a.text for a in fig.layout.annotations} == {
        "group=w · history text",
        "group=w · history token_ids",
    }


def test_reuse_outcomes_stacked_in_outcome_order():
    df = pd.DataFrame(
        {
            "mode": ["pd-bidir", "pd-bidir", "aggregated"],
            "reuse": ["miss_mismatch", "hit", "not recorded"],
            "turns": [1, 5, 4],
        }
    )
    fig = figures.reuse_outcomes(df)
    assert [t.name for t in fig.data] == ["hit", "miss_mismatch", "not recorded"]
    assert fig.layout.barmode == "stack"
    assert fig.layout.yaxis.title.text == "turns (count)"


def test_external_kv_tokens_keeps_runs_with_the_same_label_apart():
    df = pd.DataFrame(
        {
            "run_id": ["r1", "r1", "r2"],
            "run_label": ["demo", "demo", "demo"],
            "mode": ["pd-bidir"] * 3,
            "elapsed_s": [0.0, 10.0, 0.0],
            "tokens": [0.0, 512.0, 0.0],
        }
    )
    fig = figures.external_kv_tokens(df)
    assert sorted(t.name for t in fig.data) == ["demo (r1) · pd-bidir", "demo (r2) · pd-bidir"]
    assert fig.layout.xaxis.title.text == "time since run start (s)"


@pytest.mark.parametrize("fn", [figures.ttft_by_turn, figures.reuse_outcomes, figures.external_kv_tokens])
def test_empty_input_gives_a_figure_that_says_so(fn):
    fig = fn(pd.DataFrame())
    assert len(fig.data) == 0 and fig.layout.annotations[0].text.startswith("no ")


def test_run_summary_table_ms_and_hit_rate():
    df = pd.DataFrame(
        {
            "run_id": ["a", "b"],
            "label": ["x", None],
            "mode": ["pd", "pd"],
            "workload": ["w", "w"],
            "history_mode": ["text", "text"],
            "status": ["complete", "running"],
            "started_at": pd.to_datetime(["2026-01-01", "2026-01-02"], utc=True),
            "turns": [4, 0],
            "ok_turns": [4, 0],
            "failed_turns": [0, 0],
            "hits": [2, 0],
            "ttft_p50_s": [0.25, None],
            "ttft_p90_s": [0.5, None],
            "ttft_mean_s": [0.3, None],
            "reused_tokens": [100.0, None],
        }
    )
    t = tables.run_summary_table(df)
    assert list(t["run"]) == ["x", "b"]
    assert t.loc[0, "TTFT p50 (ms)"] == pytest.approx(250.0)
    assert t.loc[0, "hit rate (all turns)"] == pytest.approx(0.5) and pd.isna(
        t.loc[1, "hit rate (all turns)"]
    )
