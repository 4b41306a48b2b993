"""The Sweep page's numbers (pure functions over DataFrames): TTFT against prefix length per mode,
the speed-ups of bidirectional KV transfer with bootstrap confidence intervals, and the per-turn
ideal they are bounded by.

Inputs are ``store.queries.sweep_turns`` (one row per turn of one sweep: prefix_tokens, mode,
run_id, session_id, turn_index, status, ttft_s seconds, prompt_tokens,
expected_reusable_tokens, reuse) and ``store.queries.sweep_transfer`` (per run: mode,
prefix_tokens, xfer_s seconds, xfer_bytes bytes, reused_tokens, kv_bytes_per_token,
external_kv_tokens).

Statistics follow the vendor's benchmark (vLLM's benchmarks/multi_turn, as used by the vLLM blog
of 2026-10-12): the mean TTFT over the requests of a point (and the 90th percentile), and the
speed-up ``TTFT(baseline) / TTFT(bidirectional)`` (the blog's "1.6x lower TTFT" is 1.6 here).
Confidence intervals are percentile bootstraps (scipy.stats.bootstrap) resampling whole
sessions, the two runs independently, as on the Overview page (``analysis.headline``).

The ideal (what bidirectional transfer could give at best on this deployment): each turn of the
``pd-nocache`` run of a point, with the KV of everything the previous turn left behind
(``expected_reusable_tokens``: the previous prompt and reply, as rendered ids) pulled from D at
the measured bandwidth instead of recomputed, and only the rest prefilled:

    ideal(turn) = b0 + c(n) - c(r) + r * kv_bytes_per_token / bandwidth

with n the turn's prompt tokens, r its reusable tokens, ``b0 + c(x)`` a least-squares fit of
TTFT against prompt tokens over the sweep's ``pd-nocache`` turns (every one a full prefill on P,
P's prefix cache being off; ``c`` quadratic when there are 3 or more prompt lengths, linear with
2: attention makes long prefills super-linear), and the bandwidth P's NIXL reads reached in the
point's ``pd-bidir*`` runs (``vllm:nixl_bytes_transferred_sum`` over
``vllm:nixl_xfer_time_seconds_sum`` increases). ``c(n) - c(r)`` is the cost of the new tokens
after r cached ones. The fit is made at the sweep's concurrency, so its overhead ``b0`` and slope
include the queueing ``pd-nocache`` saw.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats
from scipy.optimize import lsq_linear

from analysis import speedup
from analysis.headline import padded_groups
from core import modes
from core.contract import HIT

#: (treatment, baseline, what the pair answers): the vendor's A/B first, then the real baselines.
#: (each mode's measured ``ServingMode.baselines``, treatments in ``core.modes.SWEEP_ORDER``.)
PAIRS: tuple[tuple[str, str, str], ...] = modes.pairs(order=modes.SWEEP_ORDER)
#: The mode whose turns are made ideal, and whose turns the prefill fit uses.
IDEAL_BASELINE = modes.RECOMPUTE_MODE
#: The statistic a speed-up divides: the median first (the dashboard's convention), the vendor's mean, the tail.
STATS = ("median", "mean", "p90")
CONFIDENCE = 0.95


def stat_of(values: np.ndarray, stat: str, axis: int = -1) -> np.ndarray | float:
    """``median``, ``mean`` or ``p90`` (linear interpolation, like DuckDB's ``quantile_cont``) of
    `values` along `axis`, ignoring NaN (the padding of whole-session resamples)."""
    if stat == "median":
        return np.nanmedian(values, axis=axis)
    if stat == "mean":
        return np.nanmean(values, axis=axis)
    if stat == "p90":
        return np.nanpercentile(values, 90, axis=axis, method="linear")
    raise ValueError(f"stat must be one of {STATS}, got {stat!r}")


def ok_turns(turns: pd.DataFrame, min_turn_index: int = 0) -> pd.DataFrame:
    """The turns that count: status ``ok`` with a TTFT, ``turn_index >= min_turn_index`` (0: every
    request, as the vendor's benchmark counts them; 1: from the second turn, where reuse can act)."""
    keep = (turns["status"] == "ok") & turns["ttft_s"].notna() & (turns["turn_index"] >= min_turn_index)
    return turns[keep]


def point_stats(turns: pd.DataFrame, min_turn_index: int = 0) -> pd.DataFrame:
    """TTFT per point and mode over the ok turns with ``turn_index >= min_turn_index``.

    Columns: prefix_tokens, mode, turns (ok turns counted), sessions, ttft_median_s, ttft_mean_s,
    ttft_p90_s (seconds), hits (turns with reuse ``hit``), failed (turns of that index range not ok).
    """
    cols = ["prefix_tokens", "mode", "turns", "sessions", "ttft_median_s", "ttft_mean_s", "ttft_p90_s", "hits",
            "failed"]
    in_range = turns[turns["turn_index"] >= min_turn_index]
    rows = []
    for (prefix, mode), g in in_range.groupby(["prefix_tokens", "mode"], sort=True):
        ok = ok_turns(g, min_turn_index)
        ttft = ok["ttft_s"].to_numpy(dtype=float)
        rows.append({
            "prefix_tokens": int(prefix), "mode": str(mode), "turns": int(ttft.size),
            "sessions": int(ok[["run_id", "session_id"]].drop_duplicates().shape[0]),
            "ttft_median_s": float(stat_of(ttft, "median")) if ttft.size else math.nan,
            "ttft_mean_s": float(stat_of(ttft, "mean")) if ttft.size else math.nan,
            "ttft_p90_s": float(stat_of(ttft, "p90")) if ttft.size else math.nan,
            "hits": int((ok["reuse"] == HIT).sum()), "failed": int(len(g) - len(ok)),
        })
    return pd.DataFrame(rows, columns=cols)


def speedup_ci(baseline_s: np.ndarray, treatment_s: np.ndarray, *, baseline_groups: np.ndarray | None = None,
               treatment_groups: np.ndarray | None = None, stat: str = "mean", confidence: float = CONFIDENCE,
               n_resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """``stat(baseline_s) / stat(treatment_s)`` (TTFTs in seconds; > 1: the treatment is faster)
    and its percentile-bootstrap confidence interval (scipy.stats.bootstrap, the two samples
    resampled independently, by whole groups when ``*_groups`` label each value's session).

    Returns (speed-up, ci_low, ci_high), dimensionless; the CI is NaN when either side has fewer
    than 2 groups.
    """
    a = np.asarray(baseline_s, dtype=float)
    b = np.asarray(treatment_s, dtype=float)
    if a.size == 0 or b.size == 0:
        raise ValueError("speedup_ci needs at least one value on each side")
    point = float(stat_of(a, stat) / stat_of(b, stat))
    pa = padded_groups(a, None if baseline_groups is None else np.asarray(baseline_groups))
    pb = padded_groups(b, None if treatment_groups is None else np.asarray(treatment_groups))
    if pa.shape[0] < 2 or pb.shape[0] < 2:
        return point, math.nan, math.nan

    def statistic(ia: np.ndarray, ib: np.ndarray, axis: int = -1) -> np.ndarray:
        ta = pa[ia].reshape(*ia.shape[:-1], -1)
        tb = pb[ib].reshape(*ib.shape[:-1], -1)
        return stat_of(ta, stat) / stat_of(tb, stat)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # identical resamples of tiny samples: the CI is a point
        res = stats.bootstrap((np.arange(pa.shape[0]), np.arange(pb.shape[0])), statistic, paired=False,
                              vectorized=True, confidence_level=confidence, n_resamples=n_resamples,
                              method="percentile", rng=np.random.default_rng(seed))
    return point, float(res.confidence_interval.low), float(res.confidence_interval.high)


def _groups(df: pd.DataFrame) -> np.ndarray:
    return (df["run_id"].astype(str) + "\x1f" + df["session_id"].astype(str)).to_numpy()


def speedups(turns: pd.DataFrame, stat: str = "mean", min_turn_index: int = 0,
             pairs: tuple[tuple[str, str, str], ...] = PAIRS, n_resamples: int = 2000) -> pd.DataFrame:
    """The speed-up of each pair of `pairs` at each point both modes have ok turns at.

    Columns: treatment, baseline, pair (``treatment vs baseline``), prefix_tokens, n_treatment,
    n_baseline (turns), treatment_s, baseline_s (the `stat` of TTFT, seconds), speedup
    (baseline / treatment), ci_low, ci_high (95% bootstrap by session; NaN with < 2 sessions).
    """
    cols = ["treatment", "baseline", "pair", "prefix_tokens", "n_treatment", "n_baseline", "treatment_s",
            "baseline_s", "speedup", "ci_low", "ci_high"]
    ok = ok_turns(turns, min_turn_index)
    rows = []
    for treatment, baseline, _ in pairs:
        for prefix, g in ok.groupby("prefix_tokens", sort=True):
            t, b = g[g["mode"] == treatment], g[g["mode"] == baseline]
            if t.empty or b.empty:
                continue
            s, lo, hi = speedup_ci(b["ttft_s"].to_numpy(), t["ttft_s"].to_numpy(), baseline_groups=_groups(b),
                                   treatment_groups=_groups(t), stat=stat, n_resamples=n_resamples)
            rows.append({"treatment": treatment, "baseline": baseline, "pair": f"{treatment} vs {baseline}",
                         "prefix_tokens": int(prefix), "n_treatment": len(t), "n_baseline": len(b),
                         "treatment_s": float(stat_of(t["ttft_s"].to_numpy(dtype=float), stat)),
                         "baseline_s": float(stat_of(b["ttft_s"].to_numpy(dtype=float), stat)),
                         "speedup": s, "ci_low": lo, "ci_high": hi})
    return pd.DataFrame(rows, columns=cols)


@dataclass(frozen=True)
class PrefillFit:
    """``TTFT = b0 + c(n)``, ``c(n) = a1 n + a2 n^2`` (n: prompt tokens; b0 s, a1 s/token, a2
    s/token^2; a2 = 0 for a linear fit), least squares over `turns` turns with prompts of
    `prompt_min`..`prompt_max` tokens."""

    b0_s: float
    a1_s: float
    a2_s: float
    degree: int
    turns: int
    prompt_min: int
    prompt_max: int

    def cost_s(self, n: np.ndarray | float) -> np.ndarray | float:
        """``c(n)``: the fitted prefill cost of `n` prompt tokens from scratch, seconds (no b0)."""
        n = np.asarray(n, dtype=float)
        return self.a1_s * n + self.a2_s * n * n

    def ttft_s(self, n: np.ndarray | float) -> np.ndarray | float:
        """The fitted TTFT of a full prefill of `n` tokens: ``b0 + c(n)``, seconds."""
        return self.b0_s + self.cost_s(n)

    def marginal_s_per_token(self, n: float) -> float:
        """``c'(n)``: the cost of one more token after `n`, seconds per token."""
        return self.a1_s + 2 * self.a2_s * n


def fit_prefill(turns: pd.DataFrame, mode: str = IDEAL_BASELINE) -> PrefillFit | None:
    """Least-squares fit of ttft_s against prompt_tokens over the ok turns of `mode` (every turn of
    ``pd-nocache`` is a full prefill on P), every coefficient bounded at >= 0 (scipy.optimize.
    lsq_linear): a fixed cost and a prefill cost cannot be negative, nor fall with more tokens (the
    planner's fit bounds its costs alike, planner.fit). Unbounded, a few slow turns at
    one length bent a sweep's quadratic downward: a negative cost per token at 2,048 tokens.
    Quadratic with 3 or more distinct prompt lengths, linear with 2; None with fewer."""
    ok = ok_turns(turns)
    ok = ok[(ok["mode"] == mode) & ok["prompt_tokens"].notna()]
    x = ok["prompt_tokens"].to_numpy(dtype=float)
    y = ok["ttft_s"].to_numpy(dtype=float)
    distinct = np.unique(x).size
    if distinct < 2:
        return None
    degree = 2 if distinct >= 3 else 1
    scale = float(x.max())  # columns of O(1): the bounded solver's tolerances are absolute
    cols = [np.ones_like(x), x / scale] + ([(x / scale) ** 2] if degree == 2 else [])
    coef = lsq_linear(np.column_stack(cols), y, bounds=(0.0, np.inf), method="bvls").x
    b0, a1 = coef[0], coef[1] / scale
    a2 = coef[2] / scale**2 if degree == 2 else 0.0
    return PrefillFit(float(b0), float(a1), float(a2), degree, int(x.size), int(x.min()), int(x.max()))


def transfer_s_per_token(transfer: pd.DataFrame) -> pd.DataFrame:
    """Measured KV transfer cost per point, from the point's ``pd-bidir*`` runs (P's pulls from D).

    bandwidth_bytes_per_s = sum(xfer_bytes) / sum(xfer_s); s_per_token =
    kv_bytes_per_token / bandwidth, or sum(xfer_s) / sum(reused_tokens) when the model's bytes per
    token are unknown. Columns: prefix_tokens, xfer_s, xfer_bytes, reused_tokens,
    bandwidth_bytes_per_s, kv_bytes_per_token, s_per_token. Points without a timed transfer get
    the whole sweep's figures (all its ``pd-bidir*`` runs pooled).
    """
    cols = ["prefix_tokens", "xfer_s", "xfer_bytes", "reused_tokens", "bandwidth_bytes_per_s",
            "kv_bytes_per_token", "s_per_token"]
    if transfer.empty:
        return pd.DataFrame(columns=cols)
    kv = transfer["kv_bytes_per_token"].dropna()
    kv_bytes = float(kv.iloc[0]) if not kv.empty else math.nan
    bidir = transfer[transfer["mode"].astype(str).isin(modes.BIDIRECTIONAL_MODES)]

    def figures(g: pd.DataFrame) -> dict:
        xs, xb, rt = (float(g[c].fillna(0).sum()) for c in ("xfer_s", "xfer_bytes", "reused_tokens"))
        bw = xb / xs if xs > 0 and xb > 0 else math.nan
        if not math.isnan(bw) and not math.isnan(kv_bytes):
            per = kv_bytes / bw
        else:
            per = xs / rt if xs > 0 and rt > 0 else math.nan
        return {"xfer_s": xs, "xfer_bytes": xb, "reused_tokens": rt, "bandwidth_bytes_per_s": bw,
                "kv_bytes_per_token": kv_bytes, "s_per_token": per}

    pooled = figures(bidir)
    rows = []
    for prefix in sorted(transfer["prefix_tokens"].unique()):
        f = figures(bidir[bidir["prefix_tokens"] == prefix])
        rows.append({"prefix_tokens": int(prefix)} | (f if not math.isnan(f["s_per_token"]) else pooled))
    return pd.DataFrame(rows, columns=cols)


def ideal_turns(turns: pd.DataFrame, fit: PrefillFit, transfer: pd.DataFrame, min_turn_index: int = 0,
                mode: str = IDEAL_BASELINE) -> pd.DataFrame:
    """The ideal TTFT of each ok turn of `mode` (see the module doc), seconds.

    `transfer` is `transfer_s_per_token`'s frame. Columns: prefix_tokens, run_id, session_id,
    turn_index, prompt_tokens, reusable_tokens (expected_reusable_tokens clipped to [0, n]; 0 when
    unknown), prefill_s (b0 + c(n) - c(r)), transfer_s (r x s_per_token), ideal_s (their sum).
    Turns at points without a transfer figure are left out.
    """
    cols = ["prefix_tokens", "run_id", "session_id", "turn_index", "prompt_tokens", "reusable_tokens",
            "prefill_s", "transfer_s", "ideal_s"]
    ok = ok_turns(turns, min_turn_index)
    ok = ok[(ok["mode"] == mode) & ok["prompt_tokens"].notna()]
    per = dict(zip(transfer["prefix_tokens"].astype(int), transfer["s_per_token"].astype(float), strict=True))
    ok = ok[ok["prefix_tokens"].astype(int).map(lambda p: not math.isnan(per.get(p, math.nan)))]
    if ok.empty:
        return pd.DataFrame(columns=cols)
    n = ok["prompt_tokens"].to_numpy(dtype=float)
    r = np.clip(ok["expected_reusable_tokens"].astype(float).fillna(0).to_numpy(), 0, n)
    prefill = fit.b0_s + fit.cost_s(n) - fit.cost_s(r)
    xfer = r * ok["prefix_tokens"].astype(int).map(per).to_numpy(dtype=float)
    return pd.DataFrame({"prefix_tokens": ok["prefix_tokens"].astype(int).to_numpy(), "run_id": ok["run_id"].to_numpy(),
                         "session_id": ok["session_id"].to_numpy(), "turn_index": ok["turn_index"].to_numpy(),
                         "prompt_tokens": n.astype(int), "reusable_tokens": r.astype(int), "prefill_s": prefill,
                         "transfer_s": xfer, "ideal_s": prefill + xfer}, columns=cols)


def ideal_stats(ideal: pd.DataFrame) -> pd.DataFrame:
    """Median, mean and p90 of the ideal TTFTs per point. Columns: prefix_tokens, turns, ideal_median_s,
    ideal_mean_s, ideal_p90_s, prefill_mean_s, transfer_mean_s (seconds)."""
    cols = ["prefix_tokens", "turns", "ideal_median_s", "ideal_mean_s", "ideal_p90_s", "prefill_mean_s",
            "transfer_mean_s"]
    rows = []
    for prefix, g in ideal.groupby("prefix_tokens", sort=True):
        v = g["ideal_s"].to_numpy(dtype=float)
        rows.append({"prefix_tokens": int(prefix), "turns": int(v.size), "ideal_median_s": float(stat_of(v, "median")),
                     "ideal_mean_s": float(stat_of(v, "mean")),
                     "ideal_p90_s": float(stat_of(v, "p90")), "prefill_mean_s": float(g["prefill_s"].mean()),
                     "transfer_mean_s": float(g["transfer_s"].mean())})
    return pd.DataFrame(rows, columns=cols)


def ideal_speedup(stats_df: pd.DataFrame, ideal: pd.DataFrame, stat: str = "mean") -> pd.DataFrame:
    """The limit of the vendor's speed-up: `stat` TTFT of ``pd-nocache`` over the ideal's, per point.
    Columns: prefix_tokens, speedup."""
    base = stats_df[stats_df["mode"] == IDEAL_BASELINE].set_index("prefix_tokens")[f"ttft_{stat}_s"]
    lim = ideal.set_index("prefix_tokens")[f"ideal_{stat}_s"]
    both = base.index.intersection(lim.index)
    return pd.DataFrame({"prefix_tokens": both.astype(int), "speedup": (base[both] / lim[both]).to_numpy()})


def _trend(g: pd.DataFrame) -> str:
    """Whether the speed-up changes from the shortest to the longest point of `g` (sorted by
    prefix): it grows or shrinks when their CIs do not overlap."""
    first, last = g.iloc[0], g.iloc[-1]
    if len(g) < 2 or any(math.isnan(x) for x in (first.ci_low, first.ci_high, last.ci_low, last.ci_high)):
        return "no trend can be told (too few points or sessions)"
    if last.ci_low > first.ci_high:
        return "the speed-up grows with prefix length"
    if last.ci_high < first.ci_low:
        return "the speed-up shrinks with prefix length"
    return "no clear trend with prefix length (the shortest and longest points' intervals overlap)"


def verdicts(sp: pd.DataFrame, stat: str = "mean") -> list[str]:
    """One plain sentence per pair in `sp` (`speedups`' frame): the speed-up at the longest and
    shortest prefixes with their CIs, faster / slower / no clear difference at the longest, and
    whether the gain grows with prefix length."""
    out = []
    for pair, g in sp.groupby("pair", sort=False):
        g = g.sort_values("prefix_tokens")
        last, first = g.iloc[-1], g.iloc[0]

        def ci(r) -> str:
            return "no CI" if math.isnan(r.ci_low) else f"95% CI {speedup.fmt_ci(r.ci_low, r.ci_high)}"

        v = speedup.verdict_of(last.ci_low, last.ci_high)
        where = {
            speedup.Verdict.TOO_FEW: "no verdict (fewer than 2 sessions)",
            speedup.Verdict.FASTER: "faster with bidirectional transfer",
            speedup.Verdict.SLOWER: "slower with bidirectional transfer",
            speedup.Verdict.UNCLEAR: "no clear difference (the interval includes 1)",
        }[v]
        out.append(f"{pair}: {speedup.fmt(last.speedup)} ({ci(last)}) {stat} TTFT {speedup.LABEL} at "
                   f"{last.prefix_tokens:,} prefix tokens, {where}; {speedup.fmt(first.speedup)} ({ci(first)}) at "
                   f"{first.prefix_tokens:,}; "
                   f"{_trend(g)}.")
    return out
