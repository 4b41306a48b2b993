"""store.console: what the read-only console accepts, refuses, and how it runs a query."""

from __future__ import annotations

import duckdb
import pytest

from store import console as sqlconsole


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT 1",
        "select * from range(3);",
        "WITH a AS (SELECT 1 AS x) SELECT * FROM a",
        "FROM range(3)",
        "DESCRIBE SELECT 1 AS a",
        "SHOW TABLES",
        "SUMMARIZE SELECT 1 AS a",
        "EXPLAIN SELECT 1",
        "EXPLAIN ANALYZE SELECT 1",
    ],
)
def test_queries_are_accepted(sql):
    assert sqlconsole.check(sql) == sql.strip()


@pytest.mark.parametrize(
    "sql, why",
    [
        ("COPY (SELECT 1) TO '/tmp/x.csv'", "COPY"),
        ("ATTACH '/tmp/x.db' AS x", "ATTACH"),
        ("DETACH x", "DETACH"),
        ("CREATE TABLE t AS SELECT 1", "CREATE"),
        ("CREATE TEMP VIEW v AS SELECT 1", "CREATE"),
        ("INSERT INTO t VALUES (1)", "INSERT"),
        ("UPDATE t SET a = 1", "UPDATE"),
        ("DELETE FROM t", "DELETE"),
        ("DROP VIEW turns", "DROP"),
        ("EXPORT DATABASE '/tmp/x'", "EXPORT"),
        ("INSTALL httpfs", "INSTALL/LOAD"),
        ("LOAD httpfs", "INSTALL/LOAD"),
        ("SET threads = 1", "SET"),
        ("USE memory", "SET"),
        ("PRAGMA threads = 1", "SET"),
        ("PRAGMA database_list", "PRAGMA"),
        ("CHECKPOINT", "CALL"),
        ("EXPLAIN ANALYZE COPY (SELECT 1) TO '/tmp/x.csv'", "EXPLAIN of a COPY"),
        ("SELECT 1; SELECT 2", "One statement at a time"),
        ("", "Nothing to run"),
        ("SELEC 1", "does not parse"),
    ],
)
def test_everything_else_is_refused_with_a_reason(sql, why):
    with pytest.raises(sqlconsole.Refused, match=why):
        sqlconsole.check(sql)


def test_run_limits_rows_and_says_so():
    con = duckdb.connect()
    try:
        df = sqlconsole.run(con, "SELECT range AS i FROM range(25000)", max_rows=10_000)
        assert len(df) == 10_000 and df.attrs["truncated"] and df["i"].iloc[-1] == 9_999
        df = sqlconsole.run(con, "SELECT 1 AS a WHERE false")
        assert list(df.columns) == ["a"] and df.empty and not df.attrs["truncated"]
    finally:
        con.close()


def test_run_interrupts_a_long_query():
    con = duckdb.connect()
    try:
        with pytest.raises(duckdb.InterruptException):
            sqlconsole.run(con, "SELECT count(*) FROM range(1000000000000)", timeout_s=0.3)
    finally:
        con.close()


def test_every_example_is_accepted():
    for name, sql in sqlconsole.EXAMPLES.items():
        assert sqlconsole.check(sql), name
