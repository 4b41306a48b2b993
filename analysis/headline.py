"""The Overview headline: does reuse make later turns faster than the real baseline?

For each pair (treatment, baseline) of serving modes, the headline is the ratio of median TTFTs
of ok turns at ``turn_index >= 1`` (the second turn onward: the first turn of a session has
nothing to reuse), i.e. ``median(TTFT treatment) / median(TTFT baseline)``, with a percentile
bootstrap confidence interval (scipy.stats.bootstrap, the two samples resampled independently, by
whole sessions: turns of one session are correlated).
Ratios are computed separately for each (workload, history_mode): comparing modes across
different workloads would be meaningless.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

from analysis import sample_size, speedup
from analysis.speedup import Verdict
from core import modes
from core.contract import HIT

#: (treatment, baseline): the feature against the baselines operators run (one-way P/D with P's
#: prefix cache on, aggregated serving), then the vendor's cache-miss scenario (P's cache off);
#: each mode's measured ``ServingMode.baselines``, treatments in display order.
PAIRS: tuple[tuple[str, str], ...] = tuple((t, b) for t, b, _ in modes.pairs())
#: First turn index (0-based) that can reuse a previous turn's KV.
MIN_TURN_INDEX = 1
CONFIDENCE = 0.95
#: About this many turns per side go into a bootstrap (whole sessions drawn at random, seeded,
#: beyond it), so a page stays fast on a million turns. The point estimate always uses every turn;
#: an interval from a subset is wider than the full data's would be (conservative, never narrower).
MAX_CI_TURNS = 1000
#: Resamples of a bootstrap whose input is such a sample (2000 otherwise).
N_RESAMPLES_SAMPLED = 1000


@dataclass(frozen=True)
class Ratio:
    """One headline number. Times in seconds; `ratio` and the CI are dimensionless (x baseline).

    `ci_low`/`ci_high` are NaN when either sample has fewer than 2 sessions.
    """

    treatment: str
    baseline: str
    workload: str | None
    history_mode: str | None
    n_treatment: int
    n_baseline: int
    median_treatment_s: float
    median_baseline_s: float
    ratio: float
    ci_low: float
    ci_high: float
    sessions_treatment: int = 0
    sessions_baseline: int = 0
    #: sessions per side that went into the bootstrap (fewer than the sessions when subsampled)
    ci_sessions_treatment: int = 0
    ci_sessions_baseline: int = 0

    @property
    def has_ci(self) -> bool:
        return not (math.isnan(self.ci_low) or math.isnan(self.ci_high))

    @property
    def ci_subsampled(self) -> bool:
        """True when the CI was bootstrapped on a subset of the sessions (see MAX_CI_TURNS)."""
        return (
            self.ci_sessions_treatment < self.sessions_treatment
            or self.ci_sessions_baseline < self.sessions_baseline
        )


def padded_groups(values: np.ndarray, groups: np.ndarray | None) -> np.ndarray:
    """`values` as a (n_groups, max group size) array, one row per group, NaN-padded."""
    if groups is None:
        return values.reshape(-1, 1)
    codes, _ = pd.factorize(pd.Series(groups), sort=True)
    order = np.argsort(codes, kind="stable")
    codes_sorted = codes[order]
    counts = np.bincount(codes)
    position = np.arange(codes.size) - np.repeat(np.cumsum(counts) - counts, counts)
    out = np.full((counts.size, counts.max()), np.nan)
    out[codes_sorted, position] = values[order]
    return out


def row_medians(x: np.ndarray) -> np.ndarray:
    """The median of each row of `x` (shape (..., n)) ignoring NaN (the padding of whole-session
    resamples): the same values as ``np.nanmedian(x, axis=-1)``, by one sort of the rows (NaN
    sorts last) and the middle one or two of each row's valid values. ``np.nanmedian`` loops in
    Python over rows longer than 600 values, which made the Overview's bootstraps take about a
    second. Every row must hold at least one value.
    """
    s = np.sort(x, axis=-1)
    n = np.count_nonzero(~np.isnan(x), axis=-1)
    lo = np.take_along_axis(s, ((n - 1) // 2)[..., None], axis=-1)[..., 0]
    hi = np.take_along_axis(s, (n // 2)[..., None], axis=-1)[..., 0]
    return (lo + hi) / 2


def ci_groups(n_groups: int, n_values: int, max_values: int | None) -> int:
    """How many of `n_groups` groups (holding `n_values` values in all) `median_ratio_ci`
    bootstraps under a `max_values` cap: all of them when ``n_values <= max_values`` (or no cap),
    else ``ceil(max_values / (n_values / n_groups))``, at least 2."""
    if max_values is None or n_values <= max_values or n_groups == 0:
        return n_groups
    return int(min(n_groups, max(2, math.ceil(max_values * n_groups / n_values))))


def median_ratio_ci(
    treatment_s: np.ndarray,
    baseline_s: np.ndarray,
    *,
    treatment_groups: np.ndarray | None = None,
    baseline_groups: np.ndarray | None = None,
    confidence: float = CONFIDENCE,
    n_resamples: int = 2000,
    seed: int = 0,
    max_values: int | None = None,
) -> tuple[float, float, float]:
    """``median(treatment_s) / median(baseline_s)`` and its bootstrap confidence interval.

    Inputs are 1-D arrays of TTFT in seconds (length >= 1). With `*_groups` (one label per value,
    e.g. the session), whole groups are resampled (a cluster bootstrap): turns of one session are
    not independent, so resampling single turns would give too narrow an interval. Without them
    each value is its own group. The CI is scipy.stats.bootstrap's percentile interval at
    `confidence`, the two samples resampled independently, with a fixed `seed`. With
    `max_values`, a sample of more values is bootstrapped on a seeded random subset of its groups
    holding about that many values (``ceil(max_values / mean group size)`` groups, at least 2):
    the ratio still uses every value, the interval is then wider (conservative). See
    `ci_groups` for the number of groups used.

    Returns (ratio, ci_low, ci_high), dimensionless; the CI is NaN when either sample has fewer
    than 2 groups.
    """
    a = np.asarray(treatment_s, dtype=float)
    b = np.asarray(baseline_s, dtype=float)
    if a.size == 0 or b.size == 0:
        raise ValueError("median_ratio_ci needs at least one value in each sample")
    ratio = float(np.median(a) / np.median(b))
    pa = padded_groups(a, None if treatment_groups is None else np.asarray(treatment_groups))
    pb = padded_groups(b, None if baseline_groups is None else np.asarray(baseline_groups))
    if pa.shape[0] < 2 or pb.shape[0] < 2:
        return ratio, math.nan, math.nan
    pick = np.random.default_rng(seed + 1)
    keep_a, keep_b = ci_groups(pa.shape[0], a.size, max_values), ci_groups(pb.shape[0], b.size, max_values)
    if keep_a < pa.shape[0]:
        pa = pa[np.sort(pick.choice(pa.shape[0], keep_a, replace=False))]
    if keep_b < pb.shape[0]:
        pb = pb[np.sort(pick.choice(pb.shape[0], keep_b, replace=False))]

    def statistic(ia: np.ndarray, ib: np.ndarray, axis: int = -1) -> np.ndarray:
        # ia, ib: resampled group indices, shape (..., n_groups); gather their turns, pooled.
        ta = pa[ia].reshape(*ia.shape[:-1], -1)
        tb = pb[ib].reshape(*ib.shape[:-1], -1)
        return row_medians(ta) / row_medians(tb)

    # Keep each vectorised batch at about 4 M floats whatever the sample sizes.
    batch = max(1, int(4e6 // max(pa.size, pb.size)))
    with warnings.catch_warnings():
        # Identical resamples (tiny or constant samples) make scipy warn; the CI is then a point.
        warnings.simplefilter("ignore")
        res = stats.bootstrap(
            (np.arange(pa.shape[0]), np.arange(pb.shape[0])),
            statistic,
            paired=False,
            vectorized=True,
            confidence_level=confidence,
            n_resamples=n_resamples,
            batch=min(batch, n_resamples),
            method="percentile",
            rng=np.random.default_rng(seed),
        )
    return ratio, float(res.confidence_interval.low), float(res.confidence_interval.high)


def _sessions(df: pd.DataFrame) -> np.ndarray | None:
    """One label per turn naming its session (session ids are unique within a run only)."""
    if not {"run_id", "session_id"} <= set(df.columns):
        return None
    return (df["run_id"].astype(str) + "\x1f" + df["session_id"].astype(str)).to_numpy()


def _count(df: pd.DataFrame) -> int:
    """Sessions in `df` (0 when it has no session columns)."""
    groups = _sessions(df)
    return 0 if groups is None else int(pd.unique(groups).size)


@dataclass(frozen=True)
class Exact:
    """Counts and the median over every turn of one side (seconds), when the bootstrap only sees
    a sample of them."""

    turns: int
    sessions: int
    median_s: float


def ratio_of(
    treatment: pd.DataFrame,
    baseline: pd.DataFrame,
    *,
    treatment_name: str,
    baseline_name: str,
    workload: str | None = None,
    history_mode: str | None = None,
    max_ci_turns: int | None = MAX_CI_TURNS,
    n_resamples: int | None = None,
    exact: tuple[Exact, Exact] | None = None,
) -> Ratio | None:
    """The `Ratio` of median ``ttft_s`` (seconds) of `treatment` over `baseline` rows, with its
    session-level bootstrap CI (`median_ratio_ci`); None when either side has no rows.

    Both frames have a ttft_s column and, for the session-level bootstrap, run_id and
    session_id. About `max_ci_turns` turns per side go into the bootstrap (`ci_groups`).
    `exact`: (treatment, baseline) counts and medians over all turns when the frames are a
    sample of them (``store.queries.ttft_stats``); the ratio, medians and counts are then
    those, and only the interval comes from the sample. `n_resamples`: the bootstrap's
    resamples; by default 2000, or `N_RESAMPLES_SAMPLED` when the interval comes from a sample
    (`exact` given and larger than the frames, or the `max_ci_turns` cap applies): that interval
    is already a conservative one, and large stores stay fast.
    """
    a = treatment["ttft_s"].to_numpy(dtype=float)
    b = baseline["ttft_s"].to_numpy(dtype=float)
    if a.size == 0 or b.size == 0:
        return None
    if n_resamples is None:
        sampled = (exact is not None and (exact[0].turns > a.size or exact[1].turns > b.size)) or (
            max_ci_turns is not None and max(a.size, b.size) > max_ci_turns
        )
        n_resamples = N_RESAMPLES_SAMPLED if sampled else 2000
    ratio, lo, hi = median_ratio_ci(
        a,
        b,
        treatment_groups=_sessions(treatment),
        baseline_groups=_sessions(baseline),
        max_values=max_ci_turns,
        n_resamples=n_resamples,
    )
    sa, sb = _count(treatment), _count(baseline)
    if exact is None:
        ea = Exact(int(a.size), sa, float(np.median(a)))
        eb = Exact(int(b.size), sb, float(np.median(b)))
    else:
        ea, eb = exact
        ratio = ea.median_s / eb.median_s
    return Ratio(
        treatment=treatment_name,
        baseline=baseline_name,
        workload=workload,
        history_mode=history_mode,
        n_treatment=ea.turns,
        n_baseline=eb.turns,
        median_treatment_s=ea.median_s,
        median_baseline_s=eb.median_s,
        ratio=ratio,
        ci_low=lo,
        ci_high=hi,
        sessions_treatment=ea.sessions,
        sessions_baseline=eb.sessions,
        ci_sessions_treatment=ci_groups(sa, int(a.size), max_ci_turns) if sa else 0,
        ci_sessions_baseline=ci_groups(sb, int(b.size), max_ci_turns) if sb else 0,
    )


def _key(v: object) -> str | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA else str(v)


def headline_ratios(
    samples: pd.DataFrame, pairs: tuple[tuple[str, str], ...] = PAIRS, stats: pd.DataFrame | None = None
) -> list[Ratio]:
    """Every pair of `pairs` whose two modes both have turns in `samples`, per workload.

    `samples` has columns mode, workload, history_mode, ttft_s (seconds) and, for the
    session-level bootstrap, run_id and session_id (without them turns are resampled singly);
    it is already restricted to
    the turns that count (ok, ``turn_index >= MIN_TURN_INDEX``; see
    ``store.queries.ttft_samples``). When `samples` is a sample of the turns, `stats`
    (``store.queries.ttft_stats``: mode, workload, history_mode, turns, sessions,
    ttft_p50_s) gives the exact medians and counts. Returns one `Ratio` per (pair, workload,
    history_mode) present, in `pairs` order.
    """
    out: list[Ratio] = []
    if samples.empty:
        return out
    exact: dict[tuple, Exact] = {}
    if stats is not None:
        for row in stats.itertuples(index=False):
            exact[(str(row.mode), _key(row.workload), _key(row.history_mode))] = Exact(
                int(row.turns), int(row.sessions), float(row.ttft_p50_s)
            )
    keyed = samples.assign(
        workload=samples["workload"].astype(object).where(samples["workload"].notna(), None),
        history_mode=samples["history_mode"].astype(object).where(samples["history_mode"].notna(), None),
    )
    groups = keyed.groupby(["workload", "history_mode"], dropna=False, sort=True)
    for treatment, baseline in pairs:
        for (workload, history_mode), g in groups:
            wl, hm = _key(workload), _key(history_mode)
            ex = (exact.get((treatment, wl, hm)), exact.get((baseline, wl, hm)))
            r = ratio_of(
                g[g["mode"] == treatment],
                g[g["mode"] == baseline],
                treatment_name=treatment,
                baseline_name=baseline,
                workload=wl,
                history_mode=hm,
                exact=ex if None not in ex else None,
            )
            if r is not None:
                out.append(r)
    return out


def missing_pairs(modes_present: set[str], pairs: tuple[tuple[str, str], ...] = PAIRS) -> list[str]:
    """A sentence per pair that cannot be computed because a mode has no later turns."""
    out = []
    for treatment, baseline in pairs:
        lacking = [m for m in (treatment, baseline) if m not in modes_present]
        if lacking:
            out.append(
                f"{treatment} vs {baseline}: no ok turns after the first in "
                + " or ".join(f"`{m}`" for m in lacking)
                + " among the selected runs."
            )
    return out


def direction(r: Ratio) -> Verdict:
    """What the CI says of the treatment (``analysis.speedup.Verdict``): ``faster`` / ``slower``
    (the CI excludes 1), ``no clear difference`` (it includes 1) or ``too few sessions`` (no CI)."""
    return speedup.of(r).verdict


def sessions_needed(r: Ratio) -> sample_size.SessionsNeeded | None:
    """The sample-size forecast (``analysis.sample_size``) for an undecided `r`; None when the
    verdict is decided or there is no CI."""
    if direction(r) is not Verdict.UNCLEAR:
        return None
    return sample_size.sessions_needed(speedup.of(r), r.ci_sessions_treatment or r.sessions_treatment,
                                       r.ci_sessions_baseline or r.sessions_baseline)


def verdict(r: Ratio) -> str:
    """One plain sentence: faster, slower or no clear difference, with the speed-up
    (``analysis.speedup``) and the numbers behind it; an undecided one ends with the forecast of
    sessions needed (``analysis.sample_size``)."""
    scope = f" ({r.workload or 'unnamed workload'}, history {r.history_mode or 'unknown'})"
    medians = (
        f"median TTFT from the second turn on {r.median_treatment_s * 1e3:.0f} ms vs "
        f"{r.median_baseline_s * 1e3:.0f} ms over {r.n_treatment} and {r.n_baseline} turns"
    )
    pct = round(CONFIDENCE * 100)
    s = speedup.of(r)
    way = s.verdict
    head = f"{speedup.LABEL} {speedup.fmt(s.value)}"
    if way is Verdict.TOO_FEW:
        return (
            f"{r.treatment} vs {r.baseline}{scope}: {head} ({medians}); too few sessions for a "
            "confidence interval, so no verdict yet."
        )
    ci = f"{pct}% CI {speedup.fmt_ci(s.ci_low, s.ci_high)}"
    if way is Verdict.FASTER:
        return (
            f"{r.treatment} is faster than {r.baseline}{scope}: {head} ({ci}; {medians}): it pays off "
            "against this baseline."
        )
    if way is Verdict.SLOWER:
        return (
            f"{r.treatment} is slower than {r.baseline}{scope}: {head} ({ci}; {medians}): it does not pay "
            "off against this baseline here."
        )
    need = sessions_needed(r)
    return (
        f"No clear difference between {r.treatment} and {r.baseline}{scope}: {head}, but the {ci} "
        f"includes 1 ({medians})." + (f" {need.sentence()}" if need else "")
    )


def answer(ratios: list[Ratio]) -> str:
    """The headline's answer in one sentence: per comparison, the treatment's verdict against its
    baseline with the speed-up and its CI (``analysis.speedup``), e.g. "pd-bidir vs pd: faster,
    1.62x (95% CI 1.20-2.05x)". Empty for no ratios."""
    pct = round(CONFIDENCE * 100)
    parts = []
    for r in ratios:
        s = speedup.of(r)
        ci = f" ({pct}% CI {speedup.fmt_ci(s.ci_low, s.ci_high)})" if s.has_ci else ""
        scope = f" [{r.workload or 'unnamed'} · {r.history_mode or '?'}]" if len({(x.workload, x.history_mode)
                                                                               for x in ratios}) > 1 else ""
        parts.append(f"{r.treatment} vs {r.baseline}{scope}: {s.verdict.value}, {speedup.fmt(s.value)}{ci}")
    return "; ".join(parts) + "." if parts else ""


def all_miss_warnings(outcomes: pd.DataFrame) -> list[str]:
    """Modes whose proxy reused nothing: a plain sentence for each.

    `outcomes` has columns mode, reuse, later_turns (see ``store.queries.reuse_outcomes``).
    A bidirectional mode (``core.modes.BIDIRECTIONAL_MODES``) with later turns but no ``hit`` means every turn recomputed its whole
    prompt (e.g. the decode handle never came back; docs/design.md), which the page must say plainly.
    """
    out = []
    bidir = outcomes[outcomes["mode"].astype(str).isin(modes.BIDIRECTIONAL_MODES)]
    for mode, g in bidir.groupby("mode", sort=True):
        later = int(g["later_turns"].sum())
        hits = int(g.loc[g["reuse"] == HIT, "later_turns"].sum())
        if later > 0 and hits == 0:
            misses = g[g["later_turns"] > 0].sort_values("later_turns", ascending=False)
            top = ", ".join(f"{row.reuse} ({int(row.later_turns)})" for row in misses.itertuples())
            out.append(
                f"Every turn after the first in `{mode}` was a miss ({later} turns: {top}): no KV "
                f"was reused from the decode worker, so this mode measured recomputation only."
            )
    return out
