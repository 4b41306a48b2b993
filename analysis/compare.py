"""Compare two runs or modes on the same workload: pure functions over the turn samples.

The inputs are ``store.queries.compare_samples``: one row per ok turn with side (``A`` the
treatment, ``B`` the baseline), run_id, session_id, turn_index, kind, ttft_s (seconds),
favourable (a ``turn`` continued within the run's proxy TTL) and case_name, possibly a sample of
whole sessions; and optionally ``store.queries.compare_stats``, the exact counts and medians
over every turn (side, scope, key, turns, sessions, ttft_p50_s). Ratios are median TTFT of A
over median TTFT of B (exact when `stats` is given) with percentile-bootstrap confidence
intervals from the samples (`analysis.headline`, scipy); the page and its sentences show them
as speed-ups B / A (``analysis.speedup``).
"""

from __future__ import annotations

import pandas as pd

from analysis import headline, speedup
from analysis.headline import Ratio

#: Per turn index each session has one turn, so turns are resampled singly; at most this many per
#: side go into each index's bootstrap (a seeded random subset beyond it: a wider interval).
MAX_CI_TURNS_PER_INDEX = 300
N_RESAMPLES_PER_INDEX = 1000
#: Turns per side `compare_samples` keeps for the bootstraps (whole sessions, sampled beyond it).
SAMPLE_TURNS = 3000
#: Cases in display order: the favourable one, then the unfavourable turn kinds.
FAVOURABLE = "continued within TTL"
UNFAVOURABLE_CASES = ("continued after TTL", "resume", "edit", "retry", "fresh")


def routing_text(prefill: object, decode: object) -> str | None:
    """How a run's proxy picked its workers, in words (``P session · D session``), or None when
    the run recorded neither policy (view ``run_config``; docs/configuration.md)."""
    def known(v: object) -> str | None:
        return v if isinstance(v, str) and v else None

    p, d = known(prefill), known(decode)
    if p is None and d is None:
        return None
    return f"P {p or '?'} · D {d or '?'}"


def compare_arms(runs: pd.DataFrame) -> pd.Series:
    """What the Compare page's ``modes`` view groups runs by, per row of `runs` (the
    ``store.queries.runs`` columns): the mode, or ``mode · P x · D y`` (:func:`routing_text`)
    when the runs of one mode in `runs` ran with more than one routing, so a comparison of
    routing policies on the same mode never pools them."""
    routing = pd.Series([routing_text(p, d) for p, d in zip(runs["prefill_routing"], runs["decode_routing"],
                                                              strict=True)], index=runs.index, dtype=object)
    mode = runs["mode"].astype(str)
    varies = routing.fillna("").groupby(mode).transform("nunique") > 1
    labelled = mode + " · " + routing.fillna("routing unknown")
    return mode.where(~varies, labelled)


def _exact(stats: pd.DataFrame | None, scope: str) -> dict[tuple[str, str], headline.Exact]:
    """(side, key) -> exact counts and median of `stats` rows of `scope`."""
    if stats is None or stats.empty:
        return {}
    rows = stats[stats["scope"] == scope]
    return {
        (str(r.side), str(r.key)): headline.Exact(int(r.turns), int(r.sessions), float(r.ttft_p50_s))
        for r in rows.itertuples(index=False)
    }


def ratio_by_turn(samples: pd.DataFrame, stats: pd.DataFrame | None = None) -> pd.DataFrame:
    """The TTFT ratio A / B of medians at each turn index both sides have, with its 95% CI.

    Medians and counts are exact with `stats` (else from `samples`); each index's interval is a
    bootstrap of its sampled turns. Returns columns turn_index, n_a, n_b (turns), median_a_s,
    median_b_s (seconds), ratio, ci_low, ci_high (dimensionless; NaN with fewer than 2 sampled
    turns on a side), ci_subsampled (bool: the interval saw fewer turns than there are). One row
    per turn index, ascending.
    """
    cols = ["turn_index", "n_a", "n_b", "median_a_s", "median_b_s", "ratio", "ci_low", "ci_high", "ci_subsampled"]
    if samples.empty:
        return pd.DataFrame(columns=cols)
    exact = _exact(stats, "turn_index")
    rows = []
    for turn_index, g in samples.groupby("turn_index", sort=True):
        a = g.loc[g["side"] == "A", "ttft_s"].to_numpy(dtype=float)
        b = g.loc[g["side"] == "B", "ttft_s"].to_numpy(dtype=float)
        if a.size == 0 or b.size == 0:
            continue
        ratio, lo, hi = headline.median_ratio_ci(
            a, b, max_values=MAX_CI_TURNS_PER_INDEX, n_resamples=N_RESAMPLES_PER_INDEX
        )
        ea, eb = exact.get(("A", str(turn_index))), exact.get(("B", str(turn_index)))
        if ea is None or eb is None:
            ea = headline.Exact(int(a.size), 0, float(pd.Series(a).median()))
            eb = headline.Exact(int(b.size), 0, float(pd.Series(b).median()))
        else:
            ratio = ea.median_s / eb.median_s
        rows.append(
            {
                "turn_index": int(turn_index),
                "n_a": ea.turns,
                "n_b": eb.turns,
                "median_a_s": ea.median_s,
                "median_b_s": eb.median_s,
                "ratio": ratio,
                "ci_low": lo,
                "ci_high": hi,
                "ci_subsampled": max(a.size, b.size) > MAX_CI_TURNS_PER_INDEX
                or a.size < ea.turns
                or b.size < eb.turns,
            }
        )
    return pd.DataFrame(rows, columns=cols)


def _later(samples: pd.DataFrame) -> pd.DataFrame:
    return samples[samples["turn_index"] >= headline.MIN_TURN_INDEX]


def side_ratios(
    samples: pd.DataFrame, a_name: str, b_name: str, stats: pd.DataFrame | None = None
) -> dict[str, Ratio | None]:
    """The three numbers of the Compare page, over ok turns with turn_index >= 1:

    ``all`` (every later turn), ``favourable`` and ``unfavourable`` (every later turn that is
    not favourable). Each is a `Ratio` of median TTFT A / B (exact with `stats`) with a
    session-level bootstrap CI from `samples` (`headline.ratio_of`), or None when a side has no
    such turns.
    """
    later = _later(samples)
    fav = later["favourable"].astype(bool)
    exact = _exact(stats, "later")
    out: dict[str, Ratio | None] = {}
    for key, rows in (("all", later), ("favourable", later[fav]), ("unfavourable", later[~fav])):
        ex = (exact.get(("A", key)), exact.get(("B", key)))
        out[key] = headline.ratio_of(
            rows[rows["side"] == "A"],
            rows[rows["side"] == "B"],
            treatment_name=a_name,
            baseline_name=b_name,
            exact=ex if None not in ex else None,
        )
    return out


def case_table(samples: pd.DataFrame, stats: pd.DataFrame | None = None) -> pd.DataFrame:
    """Median TTFT and turn counts per case and side, over ok turns with turn_index >= 1: exact
    from `stats` (scope ``case``) when given, else from `samples` (its case_name column).

    Columns: case (`FAVOURABLE` first, then `UNFAVOURABLE_CASES` order, then others), side
    (``A`` | ``B``), turns, ttft_p50_s (seconds). Cases only one side has are kept.
    """
    if stats is not None:
        c = stats[stats["scope"] == "case"]
        t = pd.DataFrame({"case": c["key"], "side": c["side"], "turns": c["turns"], "ttft_p50_s": c["ttft_p50_s"]})
    else:
        later = _later(samples)
        t = (
            later.groupby(["case_name", "side"], sort=False)["ttft_s"]
            .agg(turns="size", ttft_p50_s="median")
            .reset_index()
            .rename(columns={"case_name": "case"})
        )
    if t.empty:
        return pd.DataFrame(columns=["case", "side", "turns", "ttft_p50_s"])
    order = {c: i for i, c in enumerate((FAVOURABLE, *UNFAVOURABLE_CASES))}
    t["_o"] = t["case"].map(order).fillna(len(order))
    return t.sort_values(["_o", "case", "side"]).drop(columns="_o").reset_index(drop=True)


def _direction(r: Ratio | None) -> str:
    """``faster`` / ``slower`` (the CI excludes 1: ``headline.direction``), ``unclear`` (it
    includes 1 or there is none) or ``missing``."""
    if r is None:
        return "missing"
    v = headline.direction(r)
    return v.value if v.decided else "unclear"


def _describe(r: Ratio, what: str) -> str:
    pct = round(headline.CONFIDENCE * 100)
    s = speedup.of(r)
    ci = f"{pct}% CI {speedup.fmt_ci(s.ci_low, s.ci_high)}" if s.has_ci else "too few sessions for a CI"
    d = _direction(r)
    if d == "faster":
        head = f"{r.treatment} is faster than {r.baseline} on {what}"
    elif d == "slower":
        head = f"{r.treatment} is slower than {r.baseline} on {what}"
    else:
        head = f"No clear difference between {r.treatment} and {r.baseline} on {what}"
    return (
        f"{head}: {speedup.LABEL} {speedup.fmt(s.value)} ({ci}; median TTFT {r.median_treatment_s * 1e3:.0f} vs "
        f"{r.median_baseline_s * 1e3:.0f} ms over {r.n_treatment} and {r.n_baseline} turns)"
    )


def verdict(ratios: dict[str, Ratio | None], favourable_share: float | None = None) -> list[str]:
    """Plain sentences for the Compare page from `side_ratios`' output.

    `favourable_share`: the fraction (0..1) of A's later turns that were favourable, quoted when
    the two cases point different ways. The last sentence is the bottom line.
    """
    fav, unfav, overall = ratios.get("favourable"), ratios.get("unfavourable"), ratios.get("all")
    if overall is None:
        return ["No turns after the first on both sides: nothing to compare yet."]
    out = [_describe(overall, "all turns after the first") + "."]
    for r, what in (
        (fav, "favourable turns (continued within the TTL)"),
        (unfav, "unfavourable turns (fresh, resumed or continued after the TTL, edited, retried)"),
    ):
        if r is not None:
            out.append(_describe(r, what) + ".")
    a, b = overall.treatment, overall.baseline
    df, du = _direction(fav), _direction(unfav)
    share = f" ({favourable_share:.0%} of {a}'s later turns were favourable)" if favourable_share is not None else ""
    if df == "faster" and du in ("faster", "unclear", "missing"):
        tail = (
            "no worse where it cannot."
            if du == "unclear"
            else ("faster there too." if du == "faster" else "this traffic had no unfavourable turns.")
        )
        out.append(f"Bottom line: {a} pays off against {b} on this traffic: faster where KV can be reused, {tail}")
    elif df == "faster" and du == "slower":
        out.append(
            f"Bottom line: {a} helps continued turns but costs on the others; whether it pays depends on "
            f"the mix{share}."
        )
    elif df == "slower":
        out.append(f"Bottom line: {a} is slower than {b} even where KV could be reused: it does not pay here.")
    elif df == "unclear":
        out.append(f"Bottom line: no clear gain from {a} over {b} on the turns where reuse should help.")
    else:
        out.append(f"Bottom line: no favourable turns on both sides, so the case for {a} is not tested here.")
    return out


def workload_mismatch(a: set[tuple[str, str]], b: set[tuple[str, str]]) -> str:
    """The warning when A's and B's runs differ in (workload, history_mode) pairs `a`, `b`, in words:
    "history" alone when only the history mode differs, "workload" otherwise."""
    def words(pairs: set[tuple[str, str]]) -> str:
        return " and ".join(f"{w} with history {h}" for w, h in sorted(pairs))

    what = "carry history differently" if {w for w, _ in a} == {w for w, _ in b} else "did not run the same workload"
    advice = ("TTFT depends on how history is sent, so the speed-up mixes that in"
              if what.startswith("carry") else "a comparison across workloads says little")
    return f"A and B {what}: A ran {words(a)}, B ran {words(b)}; {advice}. Narrow the runs in the sidebar."
