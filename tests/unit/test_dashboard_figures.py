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
    # Facets named in words, without plotly's "column=" prefix.
    assert {a.text for a in fig.layout.annotations} == {"w · history text", "w · history token_ids"}


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
            "later_turns": [3, 0],  # 4 turns, the first cannot hit
            "later_hits": [2, 0],
            "ttft_p50_s": [0.25, None],
            "ttft_p90_s": [0.5, None],
            "ttft_mean_s": [0.3, None],
            "reused_tokens": [100.0, None],
        }
    )
    t = tables.run_summary_table(df)
    assert list(t["run"]) == ["x", "b"] and list(t.columns[:3]) == ["run", "mode", "history"]
    assert t.loc[0, "TTFT p50 (ms)"] == pytest.approx(250.0)
    # hits over later turns (2 / 3), not over all turns (2 / 4); no later turn: no rate
    assert t.loc[0, "hit rate (later turns)"] == pytest.approx(2 / 3) and pd.isna(
        t.loc[1, "hit rate (later turns)"]
    )


@pytest.mark.parametrize(
    "fn",
    [
        lambda d: figures.latency_panels(d, "turn_index"),
        figures.time_split,
        figures.reuse_vs_expected,
        figures.task_split,
        figures.session_timeline,
        lambda d: figures.memory_timeline(d, d),
        lambda d: figures.compare_by_turn(d, "a", "b"),
        lambda d: figures.compare_cases(d, "a", "b"),
    ],
)
def test_new_figures_say_when_empty(fn):
    fig = fn(pd.DataFrame())
    assert len(fig.data) == 0 and fig.layout.annotations[0].text.startswith("no ")


def test_whatif_empty_and_marks_the_configured_ttl_and_ds_space():
    cols = ["run_id", "run_label", "ttl_s", "later_turns", "hits", "lost_hits", "held_gib_s", "peak_held_bytes",
            "demand_peak_bytes", "capacity_bytes"]
    assert figures.whatif_ttl(pd.DataFrame(columns=cols)).layout.annotations[0].text.startswith("no ")
    mib = 2**20
    # two runs: r1 over its 100 MiB at 480 s, r2 with no known space
    df = pd.DataFrame([["r1", "one", 60.0, 10, 2, 0, 1.0, 50 * mib, 50 * mib, 100 * mib],
                       ["r1", "one", 480.0, 10, 6, 3, 8.0, 100 * mib, 130 * mib, 100 * mib],
                       ["r2", "two", 60.0, 10, 4, 0, 2.0, 20 * mib, 20 * mib, float("nan")],
                       ["r2", "two", 480.0, 10, 8, 0, 4.0, 40 * mib, 40 * mib, float("nan")]], columns=cols)
    fig = figures.whatif_ttl(df, [480.0])
    rate = next(t for t in fig.data if t.name == "pd-bidir · hit rate")
    assert list(rate.y) == pytest.approx([30.0, 70.0])  # (2 + 4) / 20, (6 + 8) / 20
    lost = next(t for t in fig.data if t.name == "pd-bidir · lost: D full")
    assert list(lost.y) == pytest.approx([0.0, 15.0])
    held = next(t for t in fig.data if t.name == "pd-bidir · KV held (GiB x s)")
    assert list(held.y) == pytest.approx([3.0, 12.0])
    space = [t for t in fig.data if t.name.endswith(": D's KV space")]
    assert [t.name for t in space] == ["one · pd-bidir: D's KV space"] and list(space[0].y) == [100.0, 100.0]
    over = next(t for t in fig.data if t.name == "exceeds D's KV space")
    assert (list(over.x), list(over.y)) == ([480.0], [130.0])
    assert {s.x0 for s in fig.layout.shapes} == {480.0}  # one line per panel
    table = tables.whatif_table(df)
    assert list(table["runs over D's space"]) == ["0 of 2", "1 of 2"]
    assert list(table["hit rate (later turns)"]) == pytest.approx([0.3, 0.7])


def test_latency_panels_ms_one_legend_entry_per_outcome_and_mode():
    df = pd.DataFrame(
        {
            "mode": ["pd-bidir", "pd-bidir", "aggregated"],
            "reuse": ["hit", "miss_first_turn", "not recorded"],
            "x": [1, 0, 1],
            "turns": [5, 5, 5],
            "ttft_p50_s": [0.1, 0.3, 0.35],
            "itl_p50_s": [0.01, 0.01, 0.012],
            "e2e_p50_s": [0.5, 0.7, 0.8],
        }
    )
    fig = figures.latency_panels(df, "turn_index")
    assert len(fig.data) == 9 and sum(bool(t.showlegend) for t in fig.data) == 3
    hit_itl = next(t for t in fig.data if t.name == "pd-bidir · hit" and t.xaxis == "x2")
    assert list(hit_itl.y) == pytest.approx([10.0])
    # Colour is the mode (the same on every page), the marker the outcome.
    first = next(t for t in fig.data if t.name == "pd-bidir · miss_first_turn")
    assert hit_itl.line.color == first.line.color == figures.MODE_COLORS["pd-bidir"]
    assert hit_itl.marker.symbol != first.marker.symbol
    assert fig.layout.xaxis.range[0] < 0  # turn-0 markers drawn whole
    assert fig.layout.legend.orientation == "h"  # under the plot, not clipped at the right


def test_reuse_vs_expected_one_expected_line_when_modes_agree():
    df = pd.DataFrame({"mode": ["pd", "pd-bidir", "pd", "pd-bidir"], "turn_index": [1, 1, 2, 2],
                       "turns": [3, 1, 3, 1], "expected_tokens": [100.0, 100.0, 200.0, 202.0],
                       "measured_tokens": [0.0, 100.0, 0.0, 190.0]})
    fig = figures.reuse_vs_expected(df)
    assert [t.name for t in fig.data] == ["expected", "pd, measured", "pd-bidir, measured"]
    # turn 2: (3 x 200 + 1 x 202) / 4 = 200.5, by hand; pd-bidir's 202 is within 5% of it.
    assert list(fig.data[0].y) == pytest.approx([100.0, 200.5])
    far = df.assign(expected_tokens=[100.0, 150.0, 200.0, 300.0])
    names = [t.name for t in figures.reuse_vs_expected(far).data]
    assert "pd-bidir, expected" in names and "pd, expected" in names and "expected" not in names


def test_time_split_bars_add_up_to_the_mean_e2e():
    df = pd.DataFrame(
        {
            "mode": ["pd-bidir", "aggregated"],
            "turn_index": [1, 1],
            "turns": [4, 4],
            "proxy_s": [0.03, 0.0],
            "prefill_s": [0.05, 0.0],
            "kv_transfer_est_s": [0.01, 0.0],
            "unsplit_ttft_s": [0.0, 0.3],
            "decode_s": [0.5, 0.5],
        }
    )
    fig = figures.time_split(df)
    assert [a.text for a in fig.layout.annotations] == ["aggregated", "pd-bidir"]  # panels in mode order
    bidir = sum(t.y[0] for t in fig.data if t.xaxis == "x2")
    assert sum(t.y[0] for t in fig.data if t.xaxis == "x") == pytest.approx(800.0)
    assert bidir == pytest.approx((0.03 + 0.05 + 0.01 + 0.5) * 1e3)
    names = {t.name for t in fig.data}
    assert "KV transfer from D (estimate)" in names and fig.layout.barmode == "stack"


def test_session_timeline_segments():
    df = pd.DataFrame(
        {
            "turn_index": [0, 1],
            "kind": ["turn", "turn"],
            "gap_kind": ["none", "tool"],
            "gap_before_s": [0.0, 2.0],
            "start_s": [0.0, 3.0],
            "ttft_s": [0.3, None],
            "e2e_s": [1.0, None],
            "status": ["ok", "timeout"],
            "reuse": ["miss_first_turn", "not recorded"],
        }
    )
    fig = figures.session_timeline(df)
    segs = {(t.name, t.y[0]): (t.base[0], t.x[0]) for t in fig.data}
    assert segs[("gap: tool", "turn 1 · turn")] == pytest.approx((1.0, 2.0))
    assert segs[("streaming", "turn 0 · turn")] == pytest.approx((0.3, 0.7))
    assert ("failed (timeout)", "turn 1 · turn") in segs


def test_task_split_other_is_what_the_parts_leave():
    df = pd.DataFrame(
        {
            "mode": ["pd"],
            "archetype": ["coding"],
            "sessions": [2],
            "task_latency_s": [10.0],
            "llm_s": [4.0],
            "tool_wait_s": [3.0],
            "think_s": [1.0],
            "pause_s": [0.5],
        }
    )
    fig = figures.task_split(df)
    other = next(t for t in fig.data if t.name.startswith("other"))
    assert list(other.x) == pytest.approx([1.5])


def test_case_table_wide_by_hand():
    long = pd.DataFrame(
        {
            "case": ["continued within TTL", "continued within TTL", "fresh"],
            "side": ["A", "B", "A"],
            "turns": [6, 3, 1],
            "ttft_p50_s": [0.1, 0.4, 0.5],
        }
    )
    t = tables.case_table(long)
    assert list(t["case"]) == ["continued within TTL", "fresh"]
    assert t.loc[0, "p50 A (ms)"] == pytest.approx(100.0) and t.loc[0, "n B"] == 3
    assert pd.isna(t.loc[1, "n B"]) and pd.isna(t.loc[1, "p50 B (ms)"])


def test_runs_keep_their_modes_colour():
    """Runs of one mode are drawn in that mode's colour (lighter for later runs), on every page."""
    colors = figures.run_colors(pd.Series({"b1": "pd-bidir", "a1": "aggregated", "b2": "pd-bidir"}))
    assert colors["b1"] == figures.MODE_COLORS["pd-bidir"] and colors["a1"] == figures.MODE_COLORS["aggregated"]
    # #2ca02c 30% towards white: 44 + 0.3 x 211 = 107.3 -> 107 = 0x6b; 160 + 0.3 x 95 = 188.5 -> 189 = 0xbd.
    assert colors["b2"] == "#6bbd6b"


def test_no_outcome_colour_is_a_mode_colour():
    # colour means the mode on every page; where it means the outcome instead, it must not collide
    from dashboard.figures import MODE_COLORS, OUTCOME_COLORS

    clash = {o: c for o, c in OUTCOME_COLORS.items() if c.lower() in {m.lower() for m in MODE_COLORS.values()}}
    assert clash == {}
    assert len(set(OUTCOME_COLORS.values())) == len(OUTCOME_COLORS)


def test_missing_figures_show_blank_not_none():
    import math

    import pandas as pd

    from dashboard import tables

    df = pd.DataFrame({"run": ["a", "b"], "NIXL (s)": [0.1304, math.nan], "x": [1.0, None]})
    out = tables.blank_missing(df, {"NIXL (s)": "{:.3f}"})
    assert list(out["NIXL (s)"]) == ["0.130", ""]
    assert out["x"].isna().tolist() == [False, True]  # columns not named are untouched


def test_plan_check_figure_draws_each_mode_in_its_colour_with_the_legend_below():
    from dashboard.figures.common import MODE_COLORS
    from dashboard.figures.plan import check_figure

    ch = pd.DataFrame({"status": "ok", "mode": ["pd", "pd-bidir", "aggregated"], "measured_ttft_s": [0.2, 0.1, 0.3],
                       "predicted_ttft_s": [0.25, 0.1, 0.3], "checked_run_id": "r", "session_id": "s",
                       "turn_index": [1, 1, 1]})
    fig = check_figure(ch)
    colours = {t.name: t.marker.color for t in fig.data if t.mode == "markers"}
    assert colours == {m: MODE_COLORS[m] for m in ("pd", "pd-bidir", "aggregated")}
    assert fig.layout.legend.orientation == "h" and fig.layout.legend.y < 0
    # log axes in ms, ticked at whole numbers in 1-2-5 steps over the drawn range (80-375 ms), not
    # plotly's "5, 2, 100, 5, 2"
    for axis in (fig.layout.xaxis, fig.layout.yaxis):
        assert axis.type == "log" and list(axis.ticktext) == ["50", "100", "200", "500"]
        assert list(axis.tickvals) == [50.0, 100.0, 200.0, 500.0]


def test_ledger_figure_one_point_per_strategy_with_interval_bars():
    from dashboard.figures.plan import ledger_figure
    from dashboard.palette import MODE_COLORS

    nan = float("nan")
    led = pd.DataFrame({"strategy": ["recompute", "pd", "pd-bidir"], "mode": ["pd-nocache", "pd", "pd-bidir"],
                        "hit_rate": [0.0, 0.5, 0.75], "p_cache_gib_s": [0.0, 10.0, 10.0],
                        "d_pinned_gib_s": [0.0, 0.0, 4.0], "host_gib_s": [0.0, 0.0, 0.0],
                        "d_pinned_interval_low_gib_s": [nan, nan, 3.0], "d_pinned_interval_high_gib_s": [nan, nan, 6.0],
                        "ttft_saved_s": [0.0, 0.1, 0.2], "ttft_saved_interval_low_s": [nan, 0.05, 0.15],
                        "ttft_saved_interval_high_s": [nan, 0.12, 0.3]})
    fig = ledger_figure(led, "FORECAST (profile t)")
    pts = {t.name: t for t in fig.data}
    assert list(pts) == ["recompute", "pd", "pd-bidir"]
    assert {n: t.marker.color for n, t in pts.items()} == {s: MODE_COLORS[m] for s, m in zip(led["strategy"], led["mode"])}
    b = pts["pd-bidir"]
    assert (b.x[0], b.y[0]) == (14.0, 200.0)   # 10 + 4 GiB-s held; 0.2 s saved
    # x bars: D pinned's interval 3-6 around 4; y bars: 150-300 ms around 200
    assert (b.error_x.arrayminus[0], b.error_x.array[0]) == (1.0, 2.0)
    assert (b.error_y.arrayminus[0], b.error_y.array[0]) == pytest.approx((50.0, 100.0))
    assert pts["recompute"].error_x is None or pts["recompute"].error_x.array is None


def test_log_ticks_whole_numbers_in_1_2_5_steps():
    from dashboard.figures.common import log_ticks

    vals, texts = log_ticks(pd.Series([3.0, 140.0, float("nan"), 0.0]))
    assert vals == [2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0]
    assert texts == ["2", "5", "10", "20", "50", "100", "200"]
    # five decades: one tick per decade, still whole numbers
    assert log_ticks(pd.Series([0.3, 1500.0]))[1] == ["0.1", "1", "10", "100", "1,000", "10,000"]


def test_palettes_keep_meanings_apart():
    from dashboard import palette

    modes = set(palette.MODE_COLORS.values())
    assert not modes & set(palette.OUTCOME_COLORS.values()) and not modes & set(palette.TIME_COLORS.values())
    assert not modes & set(palette.AB_COLORS.values())
    assert not modes & {palette.NEUTRAL, palette.NEUTRAL_DARK, palette.ALARM}  # reference lines are no mode
    # by-design outcomes are greys (r = g = b), misses that cost are not
    grey = [o for o, c in palette.OUTCOME_COLORS.items() if c[1:3] == c[3:5] == c[5:7]]
    assert sorted(grey) == sorted(palette.QUIET_OUTCOMES)
    assert palette.side_colors("pd-bidir", "pd") == {"A": "#2ca02c", "B": "#1f77b4"}
    assert palette.side_colors("pd-bidir", "pd-bidir") == palette.AB_COLORS


def test_workload_mismatch_in_words():
    from analysis.compare import workload_mismatch

    msg = workload_mismatch({("tau-bench-airline", "token_ids")}, {("tau-bench-airline", "text")})
    assert "A ran tau-bench-airline with history token_ids, B ran tau-bench-airline with history text" in msg
    assert "carry history differently" in msg and "across workloads" not in msg and "(" not in msg
    assert "did not run the same workload" in workload_mismatch({("a", "text")}, {("b", "text")})


def test_every_reuse_outcome_has_an_order_a_marker_and_a_colour():
    """An outcome added to the wire contract (as ``miss_decode_restarted`` was) is drawn like the others."""
    from core.contract import OUTCOMES
    from dashboard import palette
    from dashboard.figures.common import OUTCOME_ORDER, OUTCOME_SYMBOLS
    from store.queries import NOT_RECORDED

    expected = {*OUTCOMES, NOT_RECORDED}
    assert sorted(OUTCOME_ORDER) == sorted(expected)
    assert set(OUTCOME_SYMBOLS) == expected and set(palette.OUTCOME_COLORS) == expected
    assert OUTCOME_ORDER[0] == "hit" and set(OUTCOME_ORDER[-len(palette.QUIET_OUTCOMES):]) == set(palette.QUIET_OUTCOMES)


def test_load_curve_without_slo_on_log_axes():
    """A fleet plan without an SLO (the smallest fleet that keeps up) draws no SLO line; a TTFT 30 s
    long among 0.4 s ones puts p90 on a log axis; an overload found without a factor says its queue
    never drains. Rows: tests/planner_store.py's hand-made fleet plan, changed here."""
    from dashboard.figures import plan as plan_figures
    from tests import planner_store as fx

    fl = pd.DataFrame(fx.fleet_rows()).assign(slo_ttft_p90_s=None)
    curve = pd.DataFrame(fx.curve_rows()).assign(slo_ttft_p90_s=None)
    at = (curve["strategy"] == "pd-bidir") & (curve["load_value"] == 200.0)
    curve.loc[at, ["overloaded", "ttft_p50_s", "ttft_p90_s", "overload_role", "overload_factor"]] = \
        [False, 10.0, 30.0, None, None]
    curve.loc[curve["strategy"] == "recompute", ["overload_factor", "overload"]] = None   # as stored before words
    fig = plan_figures.load_curve_figure(curve, fl, "FORECAST (profile vendor-h200)")
    traces = {t.name: t for t in fig.data}
    assert not [n for n in traces if n.startswith("SLO")]
    assert fig.layout.yaxis.type == "log" and fig.layout.xaxis.type == "log"
    assert list(traces["pd-bidir (2P 2D)"].y) == pytest.approx([410.0, 480.0, 740.0, 30000.0])
    assert traces["recompute overloaded"].hovertext[0] == (
        "recompute on 2P 2D at 50 new sessions per hour: overloaded: P's queue never drains (no TTFT)")
    assert traces["pd overloaded"].hovertext[0] == (   # the planner's words, as stored
        "pd on 3P 3D at 200 new sessions per hour: overloaded: P at 1.15x its capacity (no TTFT)")
    knee = traces["knee (highest load at the SLO)"]   # the fixture's CURVE_KNEES, recompute none
    assert sorted(knee.x) == [50.0, 100.0, 100.0, 100.0]
    lanes = sorted(t.y[0] for n, t in traces.items() if n.endswith("overloaded"))
    assert lanes[0] > 30000 and len(set(lanes)) == 5   # each strategy its lane, above the 30 s TTFT
    _, sentence = plan_figures.fleet_headline(fl)
    assert "(SLO none (the smallest fleet that keeps up))" in sentence


def test_memory_timeline_says_which_panel_has_no_scrapes():
    """Proxy outcomes but no worker scrapes (a store of the proxy alone): the two KV panels each say
    so in the panel, the hit-rate panel draws its one run and says nothing."""
    hits = pd.DataFrame({"run_id": ["r1", "r1"], "run_label": ["one", "one"], "mode": ["pd-bidir"] * 2,
                         "elapsed_s": [0.0, 10.0], "later_turns": [2, 2], "hits": [1, 2], "hit_rate": [0.5, 1.0],
                         "bucket_s": [10.0, 10.0]})
    mem = pd.DataFrame(columns=["run_id", "run_label", "mode", "role", "name", "elapsed_s", "value"])
    fig = figures.memory_timeline(mem, hits)
    assert len(fig.data) == 1 and list(fig.data[0].y) == [50.0, 100.0]
    notes = {a.yref: a.text for a in fig.layout.annotations if a.text.startswith("no ")}
    assert notes == {"y domain": "no vllm:kv_cache_usage_perc in the selected runs",
                     "y2 domain": "no turnscope_handle_bytes_live in the selected runs"}
