"""The handed /metrics cases through the product's own route: the scraper reads the case text
from a live HTTP endpoint into the store, and the store's SQL (docs/schema/queries.md's query, the Memory
page's query) derives the case's expected values.

Two scrapes per endpoint: the case with its counters zeroed, then the case as handed, so counter
increases equal the case's values (hand-checked in each case's expect.json); gauges read the
case's values in both scrapes.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pandas as pd
import pytest

from dashboard import tables
from loadgen.scraper import MetricsScraper
from store import db, queries
from store.writer import Store
from tests.handed_cases import CASES
from tests.integration.metrics_endpoint import MetricsEndpoint, counters_zeroed, histograms_zeroed

PROM = CASES / "prometheus"
RUN = "prom-cases"
DOC_QUERY = """
SELECT run_id, role, json_extract_string(labels, '$.source') AS source,
       sum(increase) AS tokens, bool_or(reset) AS had_reset
FROM metric_increases
WHERE name = 'vllm:prompt_tokens_by_source_total'
GROUP BY ALL
ORDER BY run_id, role, source
"""


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("store")
    s = Store(root)
    s.init()
    by_source = (PROM / "prompt_tokens_by_source.prom").read_text()
    per_engine = (PROM / "per_engine_series.prom").read_text()
    prefill = MetricsEndpoint([counters_zeroed(by_source), by_source])
    decode = MetricsEndpoint([counters_zeroed(per_engine), per_engine])
    writer = s.writer(RUN, "test", flush_interval_s=60)
    try:
        now = dt.datetime.now(dt.UTC)
        writer.append("runs_log", {"run_id": RUN, "mode": "pd-bidir", "status": "complete", "started_at": now,
                                   "finished_at": now, "updated_at": now})
        scraper = MetricsScraper([(prefill.url, "prefill"), (decode.url, "decode")], writer, RUN, timeout_s=5)
        scraper.scrape_once()
        scraper.scrape_once()
    finally:
        writer.close()
        prefill.close()
        decode.close()
    return root


def test_prompt_tokens_by_source_through_the_store(store: Path) -> None:
    exp = json.loads((PROM / "prompt_tokens_by_source.expect.json").read_text())["expect"]
    con = Store(store).connect()
    try:
        rows = con.execute(DOC_QUERY).fetchall()
        total = con.execute("SELECT sum(increase) FROM metric_increases "
                            "WHERE name = 'vllm:prompt_tokens_total'").fetchone()[0]
    finally:
        con.close()
    tokens = {source: t for _, role, source, t, reset in rows if role == "prefill"}
    assert tokens == {k: exp[k] for k in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    assert total == exp["prompt_tokens_total"] == sum(tokens.values())
    reused = (tokens["local_cache_hit"] + tokens["external_kv_transfer"]) / sum(tokens.values())
    assert reused == pytest.approx(exp["reused_fraction"], abs=1e-6)


def test_per_engine_kv_usage_is_the_fullest_engine_on_the_memory_page(store: Path) -> None:
    exp = json.loads((PROM / "per_engine_series.expect.json").read_text())["expect"]
    df = db.read(db.StoreLocation(store), queries.memory_timeline, [RUN])
    decode = df[(df.role == "decode") & (df.name == queries.KV_USAGE)]
    assert not decode.empty
    # The fullest engine (0.77) in every scrape: not engine 0's 0.41, not their sum 1.18.
    assert decode.value.tolist() == pytest.approx([exp["kv_cache_usage_perc_max"]] * len(decode))
    con = Store(store).connect()
    try:
        latest = con.execute("""
            SELECT json_extract_string(labels, '$.engine') AS engine, arg_max(value, scraped_at)
            FROM metric_samples WHERE role = 'decode' AND name IN ('vllm:num_requests_running',
                                                                   'vllm:num_requests_waiting')
            GROUP BY name, engine ORDER BY ALL""").fetchall()
        counters = dict(con.execute("""
            SELECT name, sum(increase) FROM metric_increases
            WHERE role = 'decode' AND name LIKE 'vllm:prefix_cache_%_total' GROUP BY name""").fetchall())
    finally:
        con.close()
    assert sorted({e for e, _ in latest}) == exp["engines"]
    assert counters == {"vllm:prefix_cache_queries_total": exp["prefix_cache_queries"],
                        "vllm:prefix_cache_hits_total": exp["prefix_cache_hits"]}


# ------------------------------------------------- renamed metrics and per-event ITL, one run each

RENAMED_RUNS = {"old-names": "renamed_metrics_old_names", "both-names": "renamed_metrics_both_names",
                "itl-per-event": "itl_per_output_event"}
OLD_SERVER_VERSION = "0.9.1"


def _expect(stem: str) -> dict:
    return json.loads((PROM / f"{stem}.expect.json").read_text())["expect"]


@pytest.fixture(scope="module")
def renamed_store(tmp_path_factory) -> Path:
    """One run per case, each a decode worker scraped twice (counters and histograms zeroed, then
    as handed), the old-names server answering ``/version`` with an old version."""
    root = tmp_path_factory.mktemp("renamed")
    s = Store(root)
    s.init()
    for run_id, stem in RENAMED_RUNS.items():
        text = (PROM / f"{stem}.prom").read_text()
        d = MetricsEndpoint([histograms_zeroed(text), text], OLD_SERVER_VERSION if run_id == "old-names" else None)
        writer = s.writer(run_id, "test", flush_interval_s=60)
        try:
            now = dt.datetime.now(dt.UTC)
            writer.append("runs_log", {"run_id": run_id, "mode": "attach", "status": "complete", "started_at": now,
                                       "finished_at": now, "updated_at": now})
            scraper = MetricsScraper([(d.url, "decode")], writer, run_id, timeout_s=5)
            scraper.scrape_once()
            scraper.scrape_once()
        finally:
            writer.close()
            d.close()
    return root


@pytest.mark.parametrize("run_id", ["old-names", "both-names"])
def test_renamed_metrics_are_read_under_one_name_and_the_name_is_recorded(renamed_store: Path, run_id: str) -> None:
    exp = _expect(RENAMED_RUNS[run_id])
    con = Store(renamed_store).connect()
    try:
        sources = dict(con.execute("SELECT metric, source FROM metric_sources WHERE run_id = ?", [run_id]).fetchall())
        stored = {n for (n,) in con.execute("SELECT DISTINCT name FROM metric_samples WHERE run_id = ?",
                                            [run_id]).fetchall()}
        itl = con.execute("SELECT itl_events, itl_mean_s_per_event FROM server_itl WHERE run_id = ?",
                          [run_id]).fetchone()
        version = con.execute("SELECT vllm_version FROM engine_info WHERE run_id = ?", [run_id]).fetchone()[0]
    finally:
        con.close()
    assert sources["vllm:kv_cache_usage_perc"] == exp["kv_cache_usage_source"]
    assert sources["vllm:inter_token_latency_seconds"] == exp["itl_source"]
    # one name per metric stored: the deprecated twin is neither kept nor added
    assert not stored & {"vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds_count"}
    assert itl == (exp["itl_count"], pytest.approx(exp["itl_mean_s"]))  # 400 observations, not 800
    # the Memory page's query reads KV usage whichever name the server used (0.37, not 0 nor 0.74)
    df = db.read(db.StoreLocation(renamed_store), queries.memory_timeline, [run_id])
    usage = df[(df.role == "decode") & (df.name == queries.KV_USAGE)]
    assert usage.value.tolist() == pytest.approx([exp["kv_cache_usage_perc"]] * len(usage)) and len(usage) > 0
    assert version == (OLD_SERVER_VERSION if run_id == "old-names" else None)


def test_missing_metrics_are_listed_missing_never_zero(renamed_store: Path) -> None:
    exp = _expect("renamed_metrics_old_names")
    con = Store(renamed_store).connect()
    try:
        missing = [m for (m,) in con.execute("SELECT metric FROM metric_sources WHERE run_id = 'old-names' "
                                             "AND source IS NULL ORDER BY metric DESC").fetchall()]
        zeros = con.execute("SELECT count(*) FROM metric_samples WHERE run_id = 'old-names' "
                            "AND name LIKE '%prefix_cache%'").fetchone()[0]
        running = con.execute("SELECT max(value) FROM metric_samples WHERE run_id = 'old-names' "
                              "AND name = 'vllm:num_requests_running'").fetchone()[0]
    finally:
        con.close()
    assert missing == exp["missing"]
    assert zeros == 0  # no row, so no query can read a 0 hit rate
    assert running == exp["num_requests_running"]


def test_itl_per_output_event_through_the_store(renamed_store: Path) -> None:
    exp = _expect("itl_per_output_event")
    con = Store(renamed_store).connect()
    try:
        events, per_event, tokens_per_event, per_token = con.execute(
            "SELECT itl_events, itl_mean_s_per_event, tokens_per_event, itl_mean_s_per_token FROM server_itl "
            "WHERE run_id = 'itl-per-event'").fetchone()
        spec, draft = con.execute("SELECT spec_decode, spec_decode_draft_tokens FROM engine_info "
                                  "WHERE run_id = 'itl-per-event' ORDER BY scraped_at DESC").fetchone()
    finally:
        con.close()
    assert events == exp["itl_observations"]
    assert per_event == pytest.approx(exp["itl_mean_s_per_output_event"])
    assert tokens_per_event == pytest.approx(exp["tokens_per_output_event"])
    assert per_token == pytest.approx(exp["itl_mean_s_per_token"]) == pytest.approx(exp["tpot_mean_s"])
    assert spec is True and draft == pytest.approx(3.0)  # 3000 draft tokens over 1000 drafts


# ------------------------------------------------- NIXL failures and expiry, through the store's view


@pytest.fixture(scope="module")
def nixl_store(tmp_path_factory) -> Path:
    """One pd-bidir run whose P serves the handed NIXL counters (two engines), scraped twice:
    counters zeroed, then as handed, so the run's increases are the case's values."""
    root = tmp_path_factory.mktemp("nixl")
    s = Store(root)
    s.init()
    text = (PROM / "nixl_failures_and_expiry.prom").read_text()
    prefill = MetricsEndpoint([counters_zeroed(text), text])
    writer = s.writer("nixl-case", "test", flush_interval_s=60)
    try:
        now = dt.datetime.now(dt.UTC)
        writer.append("runs_log", {"run_id": "nixl-case", "mode": "pd-bidir", "status": "complete",
                                   "started_at": now, "finished_at": now, "updated_at": now})
        scraper = MetricsScraper([(prefill.url, "prefill")], writer, "nixl-case", timeout_s=5)
        scraper.scrape_once()
        scraper.scrape_once()
    finally:
        writer.close()
        prefill.close()
    return root


def test_nixl_failures_and_expiry_through_the_store(nixl_store: Path) -> None:
    """The handed case: failures summed over engines (5 + 2), notifications counted inside them
    (never added: 7, not 10), expiries apart from failures, notifications after expiry read as
    their own count (an alarm, not requests); the _created series never counted."""
    exp = _expect("nixl_failures_and_expiry")
    df = db.read(db.StoreLocation(nixl_store), queries.nixl_failures, ["nixl-case"])
    row = df.iloc[0]
    assert row.p_failed_transfers == exp["failed_transfers"]
    assert row.p_failed_notifications == exp["failed_notifications_within_failed_transfers"]
    assert row.p_kv_expired_reqs == exp["kv_expired_requests"]
    assert row.p_notifications_after_expiry == exp["notifications_after_expiry"]
    assert bool(row.p_notifications_after_expiry > 0) is exp["possible_reuse_after_expiry_alarm"]
    # no D was scraped: its counters are unknown, not 0
    assert pd.isna(row.d_failed_transfers) and pd.isna(row.d_notifications_after_expiry)
    table = tables.nixl_failures_table(df)
    assert table["P: failed transfers"].tolist() == [7] and table["P: of which notifications"].tolist() == [3]
