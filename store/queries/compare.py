"""The Compare page's queries: the two sides' turn samples and exact statistics.
"""

from __future__ import annotations

from collections.abc import Sequence

import duckdb
import pandas as pd

from store import hit_rate
from store.queries.common import TurnFilter, id_list, run_sql, where_sql

# Favourable: a continuation (kind 'turn') within the proxy's TTL (decoder_kv_blocks_ttl minus the
# margin), the case reuse is made for. Everything else after the first turn is unfavourable, by
# case: a turn continued after the TTL, or its kind.
_COMPARE_BASE = """
WITH k AS (
    SELECT CASE WHEN list_contains($a::VARCHAR[], t.run_id) THEN 'A' ELSE 'B' END AS side,
           t.run_id, t.session_id, t.turn_index, t.kind, t.ttft_s,
           coalesce(t.kind = 'turn' AND t.gap_before_s < c.decoder_kv_blocks_ttl_s - c.handle_ttl_margin_s, false)
               AS favourable
    FROM turn_rows t JOIN run_config c USING (run_id)
    WHERE (list_contains($a::VARCHAR[], t.run_id) OR list_contains($b::VARCHAR[], t.run_id))
      AND {where} AND t.status = 'ok' AND t.ttft_s IS NOT NULL
), base AS (
    SELECT k.*,
           CASE WHEN favourable THEN 'continued within TTL'
                WHEN kind = 'turn' THEN 'continued after TTL'
                ELSE coalesce(kind, 'unknown') END AS case_name
    FROM k
)
"""

_COMPARE_SAMPLES = _COMPARE_BASE + """
, n AS (SELECT side, count(*) AS side_turns FROM base GROUP BY side)
SELECT b.side, b.run_id, b.session_id, b.turn_index, b.kind, b.ttft_s, b.favourable, b.case_name
FROM base b JOIN n USING (side)
WHERE $max_turns::BIGINT IS NULL OR n.side_turns <= $max_turns::BIGINT
   OR hash(b.run_id, b.session_id) % 1000000 < 1000000.0 * $max_turns::BIGINT / n.side_turns
ORDER BY b.side, b.run_id, b.session_id, b.turn_index
"""

_COMPARE_STATS = _COMPARE_BASE + """
, later AS (
    SELECT side, run_id, session_id, ttft_s, case_name,
           CASE WHEN favourable THEN 'favourable' ELSE 'unfavourable' END AS fav
    FROM base WHERE turn_index >= $min_turn_index
), per_session AS (  -- sessions per (side, fav) and per side: count(DISTINCT) is slow, two levels are not
    SELECT side, fav, run_id, session_id FROM later GROUP BY ALL
), session_counts AS (
    SELECT side, fav AS key, count(*) AS sessions FROM per_session GROUP BY ALL
    UNION ALL
    SELECT side, 'all', count(*) FROM (SELECT DISTINCT side, run_id, session_id FROM per_session) GROUP BY side
)
SELECT side, 'turn_index' AS scope, CAST(turn_index AS VARCHAR) AS key,
       count(*) AS turns, 0 AS sessions, quantile_cont(ttft_s, 0.5) AS ttft_p50_s
FROM base GROUP BY side, turn_index
UNION ALL
SELECT side, 'case', case_name, count(*), 0, quantile_cont(ttft_s, 0.5) FROM later GROUP BY side, case_name
UNION ALL
SELECT l.side, 'later', l.key, l.turns, s.sessions, l.ttft_p50_s
FROM (SELECT side, fav AS key, count(*) AS turns, quantile_cont(ttft_s, 0.5) AS ttft_p50_s FROM later GROUP BY ALL
      UNION ALL
      SELECT side, 'all', count(*), quantile_cont(ttft_s, 0.5) FROM later GROUP BY side) l
JOIN session_counts s USING (side, key)
ORDER BY side, scope, key
"""


def _compare_where(f: TurnFilter | None) -> str:
    """`f`'s archetype and kind filters over ``turn_rows t`` (its run ids are replaced by
    the two sides')."""
    w = where_sql(TurnFilter((), *(((f.archetypes, f.kinds, f.gap_kinds)) if f else ((), (), ()))), "t")
    return w.replace("list_contains($run_ids::VARCHAR[], t.run_id)", "true")


def _compare_params(a_run_ids: Sequence[str], b_run_ids: Sequence[str], f: TurnFilter | None) -> dict:
    params = {**(f or TurnFilter(())).params(), "a": id_list(a_run_ids), "b": id_list(b_run_ids)}
    params.pop("run_ids")
    return params


def compare_samples(
    con: duckdb.DuckDBPyConnection,
    a_run_ids: Sequence[str],
    b_run_ids: Sequence[str],
    f: TurnFilter | None = None,
    max_turns: int | None = None,
) -> pd.DataFrame:
    """TTFT of the ok turns of side A (`a_run_ids`, the treatment) and side B (the baseline).

    `f`'s archetype, kind and gap-kind filters apply (its run ids do not). A run in both lists
    counts as A. With `max_turns`, a side of more turns is sampled by whole sessions (hash of run
    and session id) to about that many: the bootstraps' input; exact medians come from
    `compare_stats`. Columns: side (``A`` | ``B``), run_id, session_id, turn_index, kind,
    ttft_s (seconds), favourable (a ``turn`` continued within the run's proxy TTL: gap_before_s <
    decoder_kv_blocks_ttl - handle margin), case_name (``continued within TTL``, ``continued
    after TTL`` or the turn's kind). One row per turn kept.
    """
    params = _compare_params(a_run_ids, b_run_ids, f) | {"max_turns": None if max_turns is None else int(max_turns)}
    return run_sql(con, _COMPARE_SAMPLES.format(where=_compare_where(f)), params)


def compare_stats(
    con: duckdb.DuckDBPyConnection,
    a_run_ids: Sequence[str],
    b_run_ids: Sequence[str],
    f: TurnFilter | None = None,
    min_turn_index: int = 1,
) -> pd.DataFrame:
    """Exact counts and median TTFT of each side's ok turns (same rows as `compare_samples`
    without sampling), in three scopes:

    ``turn_index`` (key: the index, every turn), ``case`` (key: case name, turn_index >=
    `min_turn_index`), ``later`` (key: ``all``, ``favourable`` or ``unfavourable``, turn_index
    >= `min_turn_index`). Columns: side, scope, key (str), turns, sessions (distinct run and
    session; counted for scope ``later`` only, 0 otherwise), ttft_p50_s (seconds).
    """
    params = _compare_params(a_run_ids, b_run_ids, f) | {"min_turn_index": int(min_turn_index)}
    return run_sql(con, _COMPARE_STATS.format(where=_compare_where(f)), params)


_SIDE_HIT_RATES = """
SELECT CASE WHEN list_contains($a::VARCHAR[], t.run_id) THEN 'A' ELSE 'B' END AS side, {counts}
FROM turn_rows t
WHERE (list_contains($a::VARCHAR[], t.run_id) OR list_contains($b::VARCHAR[], t.run_id)) AND {where}
GROUP BY 1 ORDER BY 1
"""


def side_hit_rates(
    con: duckdb.DuckDBPyConnection,
    a_run_ids: Sequence[str],
    b_run_ids: Sequence[str],
    f: TurnFilter | None = None,
) -> pd.DataFrame:
    """Each side's reuse hit rate by ``store.hit_rate``'s one definition (hits / later turns with
    a proxy outcome). `f`'s archetype, kind and gap-kind filters apply. Columns: side (``A`` | ``B``),
    later_turns, later_hits, hit_rate (0..1, NaN without a later turn); a side with no turn is absent."""
    params = _compare_params(a_run_ids, b_run_ids, f)
    df = run_sql(con, _SIDE_HIT_RATES.format(counts=hit_rate.counts_sql("t"), where=_compare_where(f)), params)
    return df.assign(hit_rate=hit_rate.rate(df[hit_rate.HITS], df[hit_rate.LATER_TURNS]))
