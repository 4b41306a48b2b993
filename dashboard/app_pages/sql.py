"""SQL: a read-only console over the store's views (docs/schema/overview.md lists them)."""

from __future__ import annotations

import time

import duckdb
import streamlit as st

from dashboard import context
from store import console as sqlconsole
from store import db

sel = context.current()
st.title("SQL")
st.caption(
    "Read-only queries over the store's views: runs, turns, sessions, metric_samples, turn_breakdown, "
    "session_tasks, metric_increases, run_summary, mode_ab, run_config, run_kv_transfer (data/schema.sql). "
    "Writes, ATTACH, COPY … TO, settings and extensions are refused. The sidebar's filters do not apply here: "
    "the query says what it reads."
)

example = st.selectbox(
    "Examples", list(sqlconsole.EXAMPLES), index=None, placeholder="pick an example query", key="sql_example"
)
if example is not None and st.session_state.get("_sql_example_loaded") != example:
    st.session_state["sql_text"] = sqlconsole.EXAMPLES[example]
    st.session_state["_sql_example_loaded"] = example
if "sql_text" not in st.session_state:
    st.session_state["sql_text"] = sqlconsole.EXAMPLES["Run summary"]
sql = st.text_area("Query", key="sql_text", height=180)
run = st.button("Run", type="primary", icon=":material/play_arrow:", key="sql_run")

if run:
    try:
        sqlconsole.check(sql)
    except sqlconsole.Refused as exc:
        st.error(str(exc))
        st.stop()
    t0 = time.perf_counter()
    try:
        with db.connect(sel.store) as con:
            result = sqlconsole.run(con, sql)
    except sqlconsole.Refused as exc:
        st.error(str(exc))
        st.stop()
    except db.StoreBusy:
        st.warning("The store is being set up by a writer; run the query again in a moment.")
        st.stop()
    except duckdb.InterruptException:
        st.error(f"The query ran longer than {sqlconsole.TIMEOUT_S:.0f} s and was stopped.")
        st.stop()
    except duckdb.Error as exc:
        st.error(f"DuckDB: {exc}")
        st.stop()
    elapsed_ms = (time.perf_counter() - t0) * 1e3
    more = f" (the first {sqlconsole.MAX_ROWS:,}; the result has more)" if result.attrs.get("truncated") else ""
    st.caption(f"{len(result):,} rows{more} in {elapsed_ms:.0f} ms.")
    st.dataframe(result, hide_index=True, key="sql_result")
