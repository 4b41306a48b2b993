"""analysis.sweep_stats and dashboard.sweep_figures as pure functions, against numbers worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from analysis import sweep_stats
from dashboard import sweep_figures


def frame(rows: list[tuple]) -> pd.DataFrame:
    """Turns of (mode, prefix, run, session, turn, ttft_s, prompt, reusable, reuse)."""
    df = pd.DataFrame(rows, columns=["mode", "prefix_tokens", "run_id", "session_id", "turn_index", "ttft_s",
                                     "prompt_tokens", "expected_reusable_tokens", "reuse"])
    df["status"] = "ok"
    return df


def test_p90_is_linear_interpolation():
    # 0.9 x (5 - 1) = 3.6: 4 + 0.6 x (10 - 4) = 7.6
    assert sweep_stats.stat_of(np.array([1.0, 2.0, 3.0, 4.0, 10.0]), "p90") == pytest.approx(7.6)
    assert sweep_stats.stat_of(np.array([1.0, 2.0, 3.0, 4.0, 10.0]), "mean") == pytest.approx(4.0)
    assert sweep_stats.stat_of(np.array([1.0, 2.0, 3.0, 4.0, 10.0, np.nan]), "median") == pytest.approx(3.0)
    with pytest.raises(ValueError, match="stat must be one of"):
        sweep_stats.stat_of(np.array([1.0]), "p50")


def test_speedup_ci_with_two_sessions_a_side_is_the_extremes():
    """Resampling 2 sessions, "both the same session" has probability 1/4 on each side, so the
    joint extreme has 1/16 > 2.5%: the percentile interval's ends are exactly the extreme ratios."""
    base = np.array([1.0, 1.2, 1.4, 1.6])        # sessions b0: mean 1.1, b1: mean 1.5
    treat = np.array([0.5, 0.5, 0.7, 0.9])       # sessions t0: mean 0.5, t1: mean 0.8
    bg, tg = np.array(["b0", "b0", "b1", "b1"]), np.array(["t0", "t0", "t1", "t1"])
    s, lo, hi = sweep_stats.speedup_ci(base, treat, baseline_groups=bg, treatment_groups=tg)
    assert s == pytest.approx(1.3 / 0.65)
    assert lo == pytest.approx(1.1 / 0.8) and hi == pytest.approx(1.5 / 0.5)
    s1, lo1, hi1 = sweep_stats.speedup_ci(base, treat[:2], baseline_groups=bg, treatment_groups=tg[:2])
    assert s1 == pytest.approx(1.3 / 0.5) and math.isnan(lo1) and math.isnan(hi1)  # one treatment session


def test_point_stats_and_speedups():
    rows = []
    for s, extra in enumerate((0.0, 0.2)):
        for t in range(2):
            rows.append(("pd-nocache", 100, "a", f"s{s}", t, 1.0 + t, 200, None, "miss_first_turn"))
            rows.append(("pd-bidir-nocache", 100, "b", f"s{s}", t, 0.5 + extra, 200, None, "hit" if t else "x"))
    turns = frame(rows)
    turns.loc[len(turns)] = ["pd-nocache", 100, "a", "s0", 2, None, None, None, None, "timeout"]
    st = sweep_stats.point_stats(turns).set_index("mode")
    assert st.loc["pd-nocache", ["turns", "sessions", "hits", "failed"]].tolist() == [4, 2, 0, 1]
    assert st.loc["pd-nocache", "ttft_mean_s"] == pytest.approx(1.5)                 # 1, 2, 1, 2
    assert st.loc["pd-nocache", "ttft_p90_s"] == pytest.approx(2.0)                  # 1 1 2 2 at 2.7
    assert st.loc["pd-bidir-nocache", "ttft_mean_s"] == pytest.approx(0.6)           # 0.5 0.5 0.7 0.7
    assert st.loc["pd-bidir-nocache", "hits"] == 2
    sp = sweep_stats.speedups(turns)
    assert sp["pair"].tolist() == ["pd-bidir-nocache vs pd-nocache"]
    r = sp.iloc[0]
    # Baseline sessions are identical (mean 1.5); treatment session means 0.5 and 0.7.
    assert (r.speedup, r.ci_low, r.ci_high) == pytest.approx((1.5 / 0.6, 1.5 / 0.7, 1.5 / 0.5))
    later = sweep_stats.speedups(turns, min_turn_index=1).iloc[0]
    assert later.speedup == pytest.approx(2.0 / 0.6)


def test_fit_prefill_recovers_the_cost_curve():
    b0, a1, a2 = 0.04, 2e-4, 3e-8
    rows = [("pd-nocache", 0, "r", "s", 0, b0 + a1 * n + a2 * n * n, n, None, None) for n in (500, 1500, 3000, 4000)]
    fit = sweep_stats.fit_prefill(frame(rows))
    assert fit.degree == 2 and fit.turns == 4 and (fit.prompt_min, fit.prompt_max) == (500, 4000)
    assert (fit.b0_s, fit.a1_s, fit.a2_s) == pytest.approx((b0, a1, a2), rel=1e-6)
    assert fit.marginal_s_per_token(1000) == pytest.approx(a1 + 2 * a2 * 1000)
    lin = sweep_stats.fit_prefill(frame([("pd-nocache", 0, "r", "s", 0, 0.1 + 1e-3 * n, n, None, None) for n in (100, 300)]))
    assert lin.degree == 1 and (lin.b0_s, lin.a1_s, lin.a2_s) == pytest.approx((0.1, 1e-3, 0.0))
    assert sweep_stats.fit_prefill(frame([("pd-nocache", 0, "r", "s", 0, 0.2, 100, None, None)] * 3)) is None
    assert sweep_stats.fit_prefill(frame(rows).assign(mode="pd")) is None


def test_fit_prefill_never_gives_a_falling_cost():
    """The pd-nocache turns of a real sweep run (tests/integration/test_sweep_vllm.py, 2026-12-04):
    the third turns of the 256-token point (757 tokens) were slow, and the unbounded quadratic read
    a negative cost per token at 2,048 tokens (-3.1e-4 s). Bounded at >= 0, the cost rises."""
    pts = [(2129, 0.627), (2339, 0.461), (2549, 0.596), (2129, 0.677), (2339, 0.554), (2549, 0.322),
           (337, 0.067), (547, 0.134), (757, 0.542), (337, 0.123), (547, 0.210), (757, 0.468)]
    rows = [("pd-nocache", 0, "r", "s", 0, t, n, None, None) for n, t in pts]
    x, y = np.array([n for n, _ in pts], float), np.array([t for _, t in pts])
    assert np.polyval(np.polyder(np.polyfit(x, y, 2)), 2048) < 0  # what the unbounded fit said
    fit = sweep_stats.fit_prefill(frame(rows))
    assert fit.degree == 2 and min(fit.b0_s, fit.a1_s, fit.a2_s) >= 0
    assert fit.marginal_s_per_token(2048) > 0
    # a second route: the bounded fit is no worse than the best non-negative straight line through 0
    line = float(x @ y / (x @ x))
    assert np.sum((fit.ttft_s(x) - y) ** 2) <= np.sum((line * x - y) ** 2) + 1e-12


def transfer(rows: list[tuple]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["mode", "prefix_tokens", "xfer_s", "xfer_bytes", "reused_tokens",
                                       "kv_bytes_per_token"])


def test_transfer_cost_per_token():
    t = transfer([
        ("pd-nocache", 100, None, None, 0, 4096),
        ("pd-bidir-nocache", 100, 0.1, 4.096e6, 900, 4096),        # 40.96 MB/s
        ("pd-bidir", 100, 0.3, 12.288e6, 100, 4096),               # same bandwidth
        ("pd-bidir-nocache", 200, None, None, 0, 4096),            # nothing timed: the pooled figure
    ])
    got = sweep_stats.transfer_s_per_token(t).set_index("prefix_tokens")
    assert got.loc[100, "bandwidth_bytes_per_s"] == pytest.approx(40.96e6)
    assert got.loc[100, "s_per_token"] == pytest.approx(4096 / 40.96e6)  # 0.1 ms
    assert got.loc[200, "s_per_token"] == pytest.approx(4096 / 40.96e6)
    unknown = sweep_stats.transfer_s_per_token(t.assign(kv_bytes_per_token=None)).set_index("prefix_tokens")
    assert unknown.loc[100, "s_per_token"] == pytest.approx(0.4 / 1000)   # NIXL seconds per reused token


def test_ideal_turns_by_hand():
    fit = sweep_stats.PrefillFit(b0_s=0.05, a1_s=1e-3, a2_s=1e-7, degree=2, turns=9, prompt_min=0, prompt_max=0)
    turns = frame([
        ("pd-nocache", 1000, "r", "s0", 0, 9.9, 1100, None, None),
        ("pd-nocache", 1000, "r", "s0", 1, 9.9, 1400, 1250, None),
        ("pd-nocache", 1000, "r", "s0", 2, 9.9, 1700, 9999, None),  # more than the prompt: clipped
        ("pd-bidir-nocache", 1000, "q", "s0", 1, 0.1, 1400, 1250, "hit"),
    ])
    per = pd.DataFrame({"prefix_tokens": [1000], "s_per_token": [2e-5]})
    got = sweep_stats.ideal_turns(turns, fit, per)
    c = lambda x: 1e-3 * x + 1e-7 * x * x
    assert got["reusable_tokens"].tolist() == [0, 1250, 1700]
    assert got["ideal_s"].tolist() == pytest.approx([0.05 + c(1100), 0.05 + c(1400) - c(1250) + 1250 * 2e-5,
                                                     0.05 + 1700 * 2e-5])
    st = sweep_stats.ideal_stats(got).iloc[0]
    assert st.ideal_mean_s == pytest.approx(got["ideal_s"].mean()) and st.turns == 3
    stats = pd.DataFrame({"prefix_tokens": [1000], "mode": ["pd-nocache"], "ttft_mean_s": [1.0], "ttft_p90_s": [2.0]})
    lim = sweep_stats.ideal_speedup(stats, sweep_stats.ideal_stats(got))
    assert lim["speedup"].tolist() == pytest.approx([1.0 / got["ideal_s"].mean()])
    assert sweep_stats.ideal_turns(turns, fit, per.iloc[0:0]).empty  # no transfer figure: no ideal


def sp_frame(rows: list[tuple]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["pair", "baseline", "prefix_tokens", "speedup", "ci_low", "ci_high"])


def test_verdicts():
    sp = sp_frame([("a vs b", "b", 100, 1.1, 0.9, 1.3), ("a vs b", "b", 1000, 2.0, 1.8, 2.2),
                   ("a vs c", "c", 100, 0.9, 0.85, 0.95), ("a vs c", "c", 1000, 0.8, 0.7, 0.84),
                   ("a vs d", "d", 100, 1.0, 0.9, 1.1), ("a vs d", "d", 1000, 1.02, 0.95, 1.12),
                   ("a vs e", "e", 100, 1.5, math.nan, math.nan)])
    v = sweep_stats.verdicts(sp)
    assert v[0] == ("a vs b: 2.00x (95% CI 1.80-2.20x) mean TTFT speed-up at 1,000 prefix tokens, faster with "
                    "bidirectional transfer; 1.10x (95% CI 0.90-1.30x) at 100; the speed-up grows with prefix length.")
    assert "slower with bidirectional transfer" in v[1] and "the speed-up shrinks with prefix length" in v[1]
    assert "no clear difference (the interval includes 1)" in v[2] and "intervals overlap" in v[2]
    assert "no verdict (fewer than 2 sessions)" in v[3] and "no trend can be told" in v[3]


def test_speedup_figure_error_bars_and_empty_states():
    sp = sp_frame([("a vs b", "pd-nocache", 100, 1.5, 1.2, 1.9)])
    fig = sweep_figures.speedup_vs_prefix(sp, pd.DataFrame({"prefix_tokens": [100], "speedup": [3.0]}))
    pair, limit = fig.data
    assert list(pair.y) == [1.5] and list(pair.error_y.array) == pytest.approx([0.4])
    assert list(pair.error_y.arrayminus) == pytest.approx([0.3])
    assert pair.line.color == "#ff7f0e"  # the baseline's colour (pd-nocache)
    assert limit.name == sweep_figures.LIMIT_NAME and list(limit.y) == [3.0]
    assert "no point has both modes" in sweep_figures.speedup_vs_prefix(sp.iloc[0:0]).layout.annotations[0].text
    assert "no ok turns" in sweep_figures.ttft_vs_prefix(pd.DataFrame()).layout.annotations[0].text
