"""The sidebar's queries: the values its archetype, turn-kind and gap-kind filters offer.
"""

from __future__ import annotations

from collections.abc import Sequence

import duckdb
import pandas as pd

# Turn kinds and gap kinds as the contract defines them: offered as filters without scanning turns.
from core.contract import GAP_KINDS, TURN_KINDS
from store.queries.common import id_list, run_sql

_FILTER_OPTIONS = """
SELECT 'archetype' AS field, archetype AS value, count(*) AS n
FROM sessions WHERE list_contains($run_ids::VARCHAR[], run_id) AND archetype IS NOT NULL
GROUP BY ALL
ORDER BY value
"""


def filter_options(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str]) -> pd.DataFrame:
    """The values the sidebar's archetype, turn-kind and gap-kind filters can take in `run_ids`.

    Archetypes are those of the runs' finished sessions (``sessions``: small, unlike the
    turns); turn kinds and gap kinds are the contract's (`TURN_KINDS`, `GAP_KINDS`; n = NULL).
    Columns: field (``archetype`` | ``kind`` | ``gap_kind``), value, n (sessions). One row per
    (field, value).
    """
    archetypes = run_sql(con, _FILTER_OPTIONS, {"run_ids": id_list(run_ids)})
    fixed = pd.DataFrame(
        [("kind", k, None) for k in TURN_KINDS] + [("gap_kind", g, None) for g in GAP_KINDS],
        columns=["field", "value", "n"],
    )
    return pd.concat([archetypes, fixed], ignore_index=True)


#: The relations :func:`any_row` may be asked about (their names go into the SQL text).
LOGS = ("plan_log", "traffic_log")


def any_row(con: duckdb.DuckDBPyConnection, table: str) -> pd.DataFrame:
    """One row (column ``one``) if `table`, one of :data:`LOGS`, has a row, else none: whether the
    store holds forecasts or traffic reports. Raises ValueError for another table."""
    if table not in LOGS:
        raise ValueError(f"any_row reads one of {LOGS}, not {table!r}")
    return con.execute(f"SELECT 1 AS one FROM {table} LIMIT 1").df()
