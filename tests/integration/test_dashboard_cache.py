"""The dashboard's cached reads (dashboard/loader.py) over a real store: a result is reused for as
long as the store is unchanged, however long ago it was read, and a shard that lands is read at
once. The truth is the row count of the store's Parquet shards, counted by pyarrow, not by the
dashboard's code."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import streamlit as st

from dashboard import loader
from store import db
from tests import dashboard_store

CALLS: list[str] = []


def count_turns(con) -> object:
    """A query of the loader's shape, counting its own calls."""
    CALLS.append("count_turns")
    return con.execute("SELECT count(*) AS n FROM turns").df()


def parquet_rows(root: Path) -> int:
    return sum(pq.ParquetFile(p).metadata.num_rows for p in (root / "runs").glob("*/turns/*.parquet"))


@pytest.fixture()
def store_root(tmp_path: Path) -> Path:
    st.cache_data.clear()
    CALLS.clear()
    return dashboard_store.build(tmp_path / "store")


def land_shard(root: Path, run_id: str) -> int:
    """Add a copy of `run_id`'s first turns shard as a new shard, as the store's writer does: a
    temporary name, then an atomic rename into the table's directory. Returns the rows added."""
    d = root / "runs" / run_id / "turns"
    src = min(d.glob("*.parquet"))
    tmp = d / ".landing.tmp"
    shutil.copy(src, tmp)
    os.replace(tmp, d / "zz-landed-000001.parquet")
    return pq.ParquetFile(src).metadata.num_rows


def test_result_reused_while_the_store_is_unchanged(store_root):
    n = parquet_rows(store_root)
    assert loader.fetch(str(store_root), count_turns)["n"].iloc[0] == n
    # Past any short refresh interval (it was 5 s), the unchanged store is still served from the cache.
    time.sleep(6)
    assert loader.fetch(str(store_root), count_turns)["n"].iloc[0] == n
    assert CALLS == ["count_turns"]
    assert db.CACHE_TTL_S > 600


def test_new_shard_read_at_once(store_root):
    before = parquet_rows(store_root)
    assert loader.fetch(str(store_root), count_turns)["n"].iloc[0] == before
    added = land_shard(store_root, "bidir-1")
    after = parquet_rows(store_root)
    assert added > 0 and after == before + added
    assert loader.fetch(str(store_root), count_turns)["n"].iloc[0] == after
    assert CALLS == ["count_turns", "count_turns"]


def test_store_version_moves_with_writes_only(store_root):
    v0 = loader.store_version(str(store_root))
    assert loader.store_version(str(store_root)) == v0  # reading changes nothing
    land_shard(store_root, "agg-1")
    v1 = loader.store_version(str(store_root))
    assert v1 != v0
    (store_root / "runs" / "new-run" / "turns").mkdir(parents=True)  # a run that starts
    assert loader.store_version(str(store_root)) != v1
    assert loader.store_version(str(store_root / "missing")) == loader.store_version(str(store_root / "gone"))
