"""The one definition of a reuse hit rate, used by every page that shows one (the Overview's Runs
table, Memory, Compare) and by the exports.

hit rate = hits / later turns, of one serving mode (or one run): a *later turn* is a turn from a
session's second on (``turn_index >= 1``; the first turn has nothing to reuse) that carries a proxy
outcome (``reuse IS NOT NULL``: aggregated runs have no proxy, so no hit rate); a *hit* is a later
turn whose outcome is ``hit``. Rates of different modes are never pooled: a one-way mode's later
turns miss by design (``miss_no_handle_returned``) and would dilute a bidirectional mode's rate.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from core.contract import HIT

#: Column names the SQL snippet below gives, and the tables read.
LATER_TURNS = "later_turns"
HITS = "later_hits"
#: The name of the number in table headers and axis titles.
LABEL = "hit rate (later turns)"
#: The other hit rate an operator reads beside it: the worker's own prefix cache (P in P/D, the
#: single worker in aggregated), in prompt tokens, from vLLM's counters (view ``run_prefix_cache``:
#: ``prefix_cache_hits`` over ``prefix_cache_queries``). Column and label.
PREFIX_CACHE = "prefix_cache_hit_rate"
PREFIX_CACHE_LABEL = "P's own prefix-cache hit rate (tokens)"


def later_turn_sql(alias: str = "") -> str:
    """The SQL condition of a later turn, over a ``turns``-shaped relation named `alias` (or none)."""
    a = f"{alias}." if alias else ""
    return f"{a}turn_index >= 1 AND {a}reuse IS NOT NULL"


def hit_sql(alias: str = "") -> str:
    """The SQL condition of a hit (the proxy's outcome ``hit``), over a ``turns``-shaped relation
    named `alias` (or none): the one place the code's SQL writes it (data/schema.sql's views write
    it in SQL; tests/unit/test_sql_location.py fails on another)."""
    a = f"{alias}." if alias else ""
    return f"{a}reuse = '{HIT}'"


def counts_sql(alias: str = "") -> str:
    """Two aggregate columns for a SELECT grouped by run or mode: ``later_turns`` and ``later_hits``."""
    later = later_turn_sql(alias)
    return (f"count(*) FILTER (WHERE {later}) AS {LATER_TURNS}, "
            f"count(*) FILTER (WHERE {later} AND {hit_sql(alias)}) AS {HITS}")


def rate(hits, later_turns):
    """hits / later_turns (0..1) elementwise; NaN where there is no later turn. Accepts scalars,
    arrays or Series (a Series in, a Series out, index kept)."""
    h = np.asarray(hits, dtype=float)
    n = np.asarray(later_turns, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(n > 0, h / n, np.nan)
    if isinstance(later_turns, pd.Series):
        return pd.Series(out, index=later_turns.index)
    return out if out.ndim else float(out)
