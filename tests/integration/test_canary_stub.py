"""The known-answer canary through the real proxy over stub P/D workers (serving/canary.py).

Truth, independent of the proxy and the canary: the stub's output is ``gen_ids(prompt, n)`` exactly
when the KV it decodes from equals its prompt's ids (tests/integration/kv_stub.py), and it records
``kv_ok`` per decode. A ``corrupt_kv`` fault makes one leg's pulled KV wrong while it still answers
HTTP 200: the canary must say ``mismatch`` at the turn the stub's own record says was wrong, and
count it in ``turnscope_canary_mismatches_total``; without a fault it must say ``match``.
"""

import httpx

from serving.canary import CANARY_PROMPT_TOKENS, canary_prompt_ids
from tests.integration.kv_stub import ThreadServer, gen_ids
from tests.integration.test_faults_stub import proxy_config
from tests.integration.vllm_stack import ProxyThread, metric


def canary(url: str) -> dict:
    r = httpx.post(url + "/canary", json={"model": "stub"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_canary_matches_on_a_healthy_path():
    with ThreadServer("prefill") as p, ThreadServer("decode") as d, \
            ProxyThread(proxy_config(p.url, d.url)) as proxy:
        report = canary(proxy.url)
        assert report["result"] == "match", report
        t0, t1 = report["turns"]
        assert [t0["reuse"], t1["reuse"]] == ["miss_first_turn", "hit"]  # turn 1 pulled D's blocks
        # the reference is the stub's own function of the prompt: a second route to the same ids
        # 16 tokens per turn: the least (the stub's blocks of 4 and threshold 2 need fewer to pull)
        assert t0["reference_ids"] == gen_ids(canary_prompt_ids(), 16) == t0["served_ids"]
        assert t1["prompt_tokens"] == CANARY_PROMPT_TOKENS + 16 + 40
        assert metric(proxy.url, "turnscope_canaries_total", result="match") == 1
        assert metric(proxy.url, "turnscope_canary_mismatches_total") == 0
        # no client turn follows the canary: the proxy keeps no handle of it (D's TTL frees D's blocks)
        assert httpx.get(proxy.url + "/health").json()["handles_live"] == 0
        assert metric(proxy.url, "turnscope_handles_live") == 0


def test_a_corrupted_pull_that_answers_200_is_caught():
    # P's requests: 0 turn-0 prefill, 1 turn-0 reference, 2 turn-1 prefill (pulls D's blocks), 3 reference
    with ThreadServer("prefill", faults={2: {"what": "corrupt_kv"}}) as p, ThreadServer("decode") as d, \
            ProxyThread(proxy_config(p.url, d.url)) as proxy:
        report = canary(proxy.url)
        assert report["result"] == "mismatch", report
        t0, t1 = report["turns"]
        assert t0["first_mismatch"] is None and t1["first_mismatch"] is not None
        assert t1["reuse"] == "hit"  # the proxy saw a successful pull: status and outcome say nothing
        # the stub's own record: turn 1's decode (D's second request) decoded from wrong KV
        decodes = [e for e in d.app.state.events if e["event"] == "decode"]
        assert [e["kv_ok"] for e in decodes] == [True, False]
        assert metric(proxy.url, "turnscope_canary_mismatches_total") == 1
        assert metric(proxy.url, "turnscope_canaries_total", result="mismatch") == 1
        # a second canary on the now healthy path matches (a fresh salt and session: nothing kept)
        assert canary(proxy.url)["result"] == "match"
        assert metric(proxy.url, "turnscope_canary_mismatches_total") == 1


def test_a_wrong_decode_is_caught_at_its_first_token():
    # D's requests: 0 turn-0 decode (its pull of P's blocks corrupted)
    with ThreadServer("prefill") as p, ThreadServer("decode", faults={0: {"what": "corrupt_kv"}}) as d, \
            ProxyThread(proxy_config(p.url, d.url)) as proxy:
        report = canary(proxy.url)
        assert report["result"] == "mismatch"
        assert report["turns"][0]["first_mismatch"] is not None


def test_a_failed_request_is_an_error_not_a_mismatch():
    with ThreadServer("prefill", faults={0: {"what": "status", "status": 500}}) as p, ThreadServer("decode") as d, \
            ProxyThread(proxy_config(p.url, d.url)) as proxy:
        report = canary(proxy.url)
        assert report["result"] == "error" and "serving path" in report["error"]
        assert metric(proxy.url, "turnscope_canaries_total", result="error") == 1
        assert metric(proxy.url, "turnscope_canary_mismatches_total") == 0


def test_turnscope_check_exits_1_on_wrong_tokens():
    from typer.testing import CliRunner

    from turnscope.commands import app

    runner = CliRunner()
    with ThreadServer("prefill") as p, ThreadServer("decode", faults={1: {"what": "corrupt_kv"}}) as d, \
            ProxyThread(proxy_config(p.url, d.url)) as proxy:
        # D's requests: 0, 1 the first canary's turns (1 corrupted); 2, 3 the second's
        bad = runner.invoke(app, ["check", "--proxy", proxy.url, "--model", "stub", "--count", "2"])
        good = runner.invoke(app, ["check", "--proxy", proxy.url, "--model", "stub"])
    assert bad.exit_code == 1, bad.output
    assert "canary 1/2: mismatch against prefill-0" in bad.output and "canary 2/2: match" in bad.output
    assert "1 of 2 canaries answered wrong tokens" in bad.output
    assert good.exit_code == 0 and "turn 1 (hit): same ids" in good.output, good.output
