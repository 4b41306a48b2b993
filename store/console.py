"""The SQL page's read-only console: which statements may run, and running one with limits.

The connection is read-only (``store.db``), so DuckDB itself refuses writes to the store's
file; but a read-only connection can still ATTACH another database, COPY query results TO a file,
EXPORT, INSTALL/LOAD extensions or change settings. So before anything runs, DuckDB's own parser
splits the text into statements and only one query is accepted: SELECT (including WITH, FROM-first,
DESCRIBE, SHOW, SUMMARIZE), or EXPLAIN [ANALYZE] of one. Everything else is refused with a
message that says why.
"""

from __future__ import annotations

import re
import threading

import duckdb
import pandas as pd
import pyarrow as pa

#: Rows shown at most; the console says when a result had more.
MAX_ROWS = 10_000
#: A query running longer than this (seconds) is interrupted.
TIMEOUT_S = 30.0

_EXPLAIN = re.compile(r"^\s*explain\s+(analyze\s+|analyse\s+)?", re.IGNORECASE)

#: The query ``turnscope demo`` suggests for the ``duckdb`` shell when it ends (one line).
SHELL_EXAMPLE = "select mode, history_mode, turn_index, median(ttft_s) from turn_breakdown group by all order by all"

EXAMPLES: dict[str, str] = {
    "TTFT p50 by mode and turn index": """SELECT mode, history_mode, turn_index, count(*) AS turns,
       round(median(ttft_s) * 1000, 1) AS ttft_p50_ms
FROM turn_breakdown
WHERE status = 'ok'
GROUP BY ALL
ORDER BY ALL""",
    "Reuse outcomes per run": """SELECT run_label, mode, coalesce(reuse, 'not recorded') AS reuse, count(*) AS turns
FROM turn_breakdown
GROUP BY ALL
ORDER BY run_label, turns DESC""",
    "Turns that reused less than expected": """SELECT run_label, session_id, turn_index, kind, reuse,
       expected_reusable_tokens, measured_reused_tokens,
       expected_reusable_tokens - measured_reused_tokens AS shortfall_tokens
FROM turn_breakdown
WHERE status = 'ok' AND turn_index >= 1
  AND expected_reusable_tokens - measured_reused_tokens >= 128
ORDER BY shortfall_tokens DESC
LIMIT 50""",
    "Task latency split per archetype": """SELECT mode, archetype, count(*) AS sessions,
       round(avg(task_latency_s), 2) AS task_s, round(avg(llm_s), 2) AS llm_s,
       round(avg(tool_wait_s), 2) AS tool_s, round(avg(think_s), 2) AS think_s,
       round(avg(pause_s), 2) AS pause_s
FROM session_tasks
GROUP BY ALL
ORDER BY ALL""",
    "Run summary": "SELECT * FROM run_summary ORDER BY started_at",
    "KV transfer per run (NIXL, prefill)": "SELECT * FROM run_kv_transfer ORDER BY run_id",
    "Per-run settings": "SELECT * FROM run_config ORDER BY run_id",
    "The store's views": """SELECT view_name, sql
FROM duckdb_views()
WHERE NOT internal AND view_name NOT LIKE '\\_%' ESCAPE '\\'
ORDER BY view_name""",
}


class Refused(ValueError):
    """The console will not run this text; the message says why, for the operator."""


_TYPE_NAMES = {
    "INSERT": "INSERT writes rows",
    "UPDATE": "UPDATE writes rows",
    "DELETE": "DELETE writes rows",
    "CREATE": "CREATE makes objects",
    "DROP": "DROP removes objects",
    "ALTER": "ALTER changes objects",
    "ATTACH": "ATTACH opens another database",
    "DETACH": "DETACH closes a database",
    "COPY": "COPY reads into tables or writes files (COPY ... TO)",
    "EXPORT": "EXPORT DATABASE writes files",
    "LOAD": "INSTALL/LOAD changes extensions",
    "SET": "SET/USE/RESET changes settings",
    "VARIABLE_SET": "SET VARIABLE changes settings",
    "PRAGMA": "PRAGMA can change settings",
    "CALL": "CALL runs procedures (e.g. CHECKPOINT)",
    "TRANSACTION": "transactions are not needed to read",
    "VACUUM": "VACUUM writes",
    "UPDATE_EXTENSIONS": "UPDATE EXTENSIONS changes extensions",
}


def check(sql: str) -> str:
    """The one statement of `sql` if the console may run it; raises `Refused` otherwise.

    Accepted: exactly one SELECT-type statement (SELECT, WITH, FROM-first, DESCRIBE, SHOW,
    SUMMARIZE, VALUES), or EXPLAIN [ANALYZE] of one. A trailing semicolon is fine.
    """
    text = (sql or "").strip()
    if not text:
        raise Refused("Nothing to run: type a query over the views (e.g. SELECT * FROM run_summary).")
    try:
        statements = duckdb.extract_statements(text)
    except duckdb.Error as exc:
        raise Refused(f"The query does not parse: {exc}") from exc
    if len(statements) != 1:
        raise Refused(f"One statement at a time, please: this text holds {len(statements)}.")
    stmt = statements[0]
    kind = stmt.type.name
    if kind == "EXPLAIN":
        inner = _EXPLAIN.sub("", text, count=1)
        inner_kind = duckdb.extract_statements(inner)[0].type.name if inner.strip() else "NONE"
        if inner_kind != "SELECT":
            raise Refused(
                f"Refused: EXPLAIN of a {inner_kind} statement (EXPLAIN ANALYZE would run it). "
                "This console is read-only: only queries (SELECT) can be explained."
            )
        return text
    if kind != "SELECT":
        why = _TYPE_NAMES.get(kind, f"{kind} is not a query")
        raise Refused(
            f"Refused: this console is read-only and runs only queries (SELECT, WITH, DESCRIBE, SHOW, "
            f"EXPLAIN); {why}. Anything else belongs in the `duckdb` shell, outside the dashboard."
        )
    return text


def run(con: duckdb.DuckDBPyConnection, sql: str, max_rows: int = MAX_ROWS, timeout_s: float = TIMEOUT_S) -> pd.DataFrame:
    """Run `sql` (after `check`) on `con` and return at most `max_rows` rows as a DataFrame.

    ``df.attrs["truncated"]`` is True when the result had more rows. A query running longer than
    `timeout_s` seconds is interrupted (``duckdb.InterruptException``). Raises `Refused` for text
    `check` refuses and DuckDB's errors for a query that fails.
    """
    text = check(sql)
    timer = threading.Timer(timeout_s, con.interrupt)
    timer.daemon = True
    timer.start()
    try:
        reader = con.sql(text).to_arrow_reader(max(1, min(max_rows + 1, 100_000)))
        batches, rows = [], 0
        for batch in reader:
            batches.append(batch)
            rows += batch.num_rows
            if rows > max_rows:
                break
        table = pa.Table.from_batches(batches, schema=reader.schema)
    finally:
        timer.cancel()
    df = table.slice(0, max_rows).to_pandas()
    df.attrs["truncated"] = rows > max_rows
    return df
