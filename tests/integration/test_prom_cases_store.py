"""The handed /metrics cases through the product's own route: the scraper reads the case text
from a live HTTP endpoint into the store, and the store's SQL (docs/schema.md's query, the Memory
page's query) derives the case's expected values.

Two scrapes per endpoint: the case with its counters zeroed, then the case as handed, so counter
increases equal the case's values (hand-checked in each case's expect.json); gauges read the
case's values in both scrapes.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dashboard import db, queries
from loadgen.scraper import MetricsScraper
from tests.handed_cases import CASES
from turnscope.store import Store

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


def _zeroed(text: str) -> str:
    """The same series with every counter (``_total``) at 0: the scrape before the case's."""
    return "\n".join(re.sub(r"\S+$", "0.0", line) if re.match(r"[^#\s{]+_total[{ ]", line) else line
                     for line in text.splitlines()) + "\n"


class _Endpoint:
    """Serves /metrics from a list of texts, one per GET (the last one repeats)."""

    def __init__(self, texts: list[str]):
        self.texts = list(texts)
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = (endpoint.texts.pop(0) if len(endpoint.texts) > 1 else endpoint.texts[0]).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("store")
    s = Store(root)
    s.init()
    by_source = (PROM / "prompt_tokens_by_source.prom").read_text()
    per_engine = (PROM / "per_engine_series.prom").read_text()
    prefill = _Endpoint([_zeroed(by_source), by_source])
    decode = _Endpoint([_zeroed(per_engine), per_engine])
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
