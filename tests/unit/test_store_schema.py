"""Pure checks of schema.sql parsing and row conversion in store.writer."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pyarrow as pa
import pytest

from store.writer import SCHEMA_PATH, load_schema


def test_store_schema_types_from_contract() -> None:
    s = load_schema()
    assert {"runs_log", "sessions", "turns", "metric_samples", "traffic_log", "traffic_requests"} <= set(s.tables)
    # the plan_* tables (docs/schema/plans.md): a plan's checked run is not the shard's run_id
    assert {"plan_log", "plan_requests", "plan_checks"} <= set(s.tables)
    assert s.tables["plan_checks"].column("run_id") is None
    assert not s.tables["plan_checks"].column("checked_run_id").nullable
    ms = s.tables["metric_samples"].arrow_schema()
    assert ms.field("scraped_at").type == pa.timestamp("us", tz="UTC")
    assert ms.field("labels").type == pa.string()
    assert ms.field("value").type == pa.float64()
    assert s.tables["turns"].arrow_schema().field("turn_index").type == pa.int32()
    assert not s.tables["turns"].column("session_id").nullable
    assert s.tables["turns"].column("ttft_s").nullable


def test_store_schema_missing_section(tmp_path: Path) -> None:
    p = tmp_path / "schema.sql"
    p.write_text(SCHEMA_PATH.read_text().replace("-- section: views", "-- views"))
    with pytest.raises(ValueError, match=r"schema.sql: missing '-- section: views'"):
        load_schema(p)


def test_store_schema_unmapped_type(tmp_path: Path) -> None:
    p = tmp_path / "schema.sql"
    p.write_text("-- section: tables\nCREATE TABLE t (a HUGEINT);\n-- section: views\n")
    with pytest.raises(ValueError, match="table t, column a: type HUGEINT"):
        load_schema(p)


def test_store_convert_timestamp_to_utc() -> None:
    from store.writer import _convert

    col = load_schema().tables["turns"].column("sent_at")
    ist = dt.timezone(dt.timedelta(hours=5, minutes=30))
    out = _convert("turns", col, dt.datetime(2026, 4, 29, 18, 8, 0, 250000, tzinfo=ist))
    assert out == dt.datetime(2026, 4, 29, 12, 38, 0, 250000, tzinfo=dt.UTC)
    assert out.utcoffset() == dt.timedelta(0)
