"""Turn kinds, workloads and Locust (local, web UI, distributed) against the local stub server.

Truths: what the stub received (every request body, in order), hand-written histories in the
stub's character-level ChatML (one id per character), the plans computed here from the same
workload file and seed, and the stub's own request count (count sent == count stored).
"""

from __future__ import annotations

import subprocess
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from loadgen.session import SessionPlan, TurnPlan
from loadgen.session_player import run_session
from loadgen.synth_text import LocalTokenizer, TextSynth
from loadgen.workload import load_workload, plan_workload
from store.writer import Store
from tests import embedded_tokenizer
from tests.integration import openai_stub
from tests.integration.openai_stub import CHAR_BASE, IM_END, XY, StubServer, StubState, encode, render
from tests.integration.test_session_stub import _free_port, _locust_cmd, _locust_env, rows

pytestmark = pytest.mark.timing

REPO = Path(__file__).resolve().parents[2]
NL = CHAR_BASE + ord("\n")
REPLY = encode("ok") + [XY] + encode(".")        # text "okxy.", which re-encodes as o k x y .
S = {"role": "system", "content": "Be brief."}
U1 = {"role": "user", "content": "Find my booking."}
F = {"role": "user", "content": "Title this chat."}
U2 = {"role": "user", "content": "And the return?"}
T = {"role": "tool", "tool_call_id": "call_4", "content": "{\"ok\": true}"}
U3 = {"role": "user", "content": "Back again."}
REF = {"role": "assistant", "content": "ref"}
PLAN = SessionPlan("kinds", "test:kinds", [
    TurnPlan([S, U1], REF),
    TurnPlan([F], REF, 0.0, "none", "fresh", max_tokens=3),
    TurnPlan([U2], REF, 0.1, "think", "turn"),
    TurnPlan([], REF, 0.0, "none", "retry"),
    TurnPlan([T], REF, 0.1, "tool", "edit", edit={"style": "compact", "target": "last", "keep": 0.5}),
    TurnPlan([U3], REF, 0.2, "pause", "resume"),
], archetype="hand")


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "store")
    s.init()
    return s


def ids_of(messages):
    return encode(render(messages, True))


@pytest.mark.parametrize("mode", ["text", "token_ids"])
def test_turn_kinds_reach_the_server_as_real_requests(store, mode):
    state = StubState(ttft_s=0.01, itl_s=0.0, reply_ids=lambda i: list(REPLY))
    with StubServer(state) as srv, httpx.Client() as client, store.writer("r1", "w") as writer:
        result = run_session(PLAN, client, srv.url, "m", writer, "r1", mode, max_tokens=8)
    assert result.stopped == "complete"
    reqs = state.requests
    assert len(reqs) == 6
    conv = "r1/kinds"
    assert [r["conversation_id"] for r in reqs] == [conv, f"{conv}~fresh1", conv, conv, conv, conv]
    reply = {"role": "assistant", "content": "okxy."}
    compacted = {"role": "assistant", "content": "ok"}       # "okxy." keep 0.5 -> int(2.5) = 2 characters
    hist2 = [S, U1, reply, U2]                                # the fresh request left the history alone
    hist4 = [*hist2, compacted, T]                            # the retry's reply, compacted, then the tool
    hist5 = [*hist4, reply, U3]                               # the compaction persists
    p = [r["prompt_ids"] for r in reqs]
    if mode == "text":
        assert [r["messages"] for r in reqs] == [[S, U1], [F], hist2, hist2, hist4, hist5]
        assert [len(x) for x in p] == [len(ids_of(m)) for m in ([S, U1], [F], hist2, hist2, hist4, hist5)]
    else:
        assert p[1] == ids_of([F])
        assert p[2] == p[0] + REPLY + [IM_END, NL] + ids_of([U2])
        assert p[3] == p[2]                                   # the retry resends the same ids
        assert p[4] == ids_of(hist4)                          # an edit is re-rendered from the text
        assert p[5] == p[4] + REPLY + [IM_END, NL] + ids_of([U3])
    assert [r["max_tokens"] for r in reqs] == [8, 3, 8, 8, 8, 8]

    turns = rows(store, "SELECT * FROM turns ORDER BY sent_at")
    assert [(t["session_id"], t["turn_index"], t["kind"], t["gap_kind"]) for t in turns] == [
        ("kinds", 0, "turn", "none"), ("kinds~fresh1", 0, "fresh", "none"), ("kinds", 1, "turn", "think"),
        ("kinds", 2, "retry", "none"), ("kinds", 3, "edit", "tool"), ("kinds", 4, "resume", "pause")]
    assert [t["reuse"] for t in turns] == ["miss_first_turn", "miss_first_turn", "hit", "hit", "hit", "hit"]
    assert turns[2]["gap_before_s"] >= 0.1 and turns[4]["gap_before_s"] >= 0.1 and turns[5]["gap_before_s"] >= 0.2
    # expected reuse, by hand over the ids the stub saw
    exp = [(t["expected_reusable_tokens"], t["divergence_position"]) for t in turns]
    assert exp[0] == exp[1] == (0, None)                      # first turn; fresh: its own conversation, nothing before
    assert exp[3] == (len(p[2]), len(p[2]))                   # a retry's prompt ends inside the span
    if mode == "text":                                        # the generated XY comes back as x, y
        assert exp[2] == (len(p[0]) + 2, len(p[0]) + 2) and exp[5] == (len(p[4]) + 2, len(p[4]) + 2)
        assert exp[4] == (len(p[3]) + 2, len(p[3]) + 2)       # "ok" kept, then the compaction's <|im_end|>
    else:                                                     # ids continue exactly ...
        assert exp[2] == (len(p[0]) + 4, None) and exp[5] == (len(p[4]) + 4, None)
        # ... except that an edit re-renders the text history, where the first reply's generated
        # XY is re-tokenized as x, y: the ids diverge right after its "ok"
        assert exp[4] == (len(p[0]) + 2, len(p[0]) + 2)
    sessions = {s["session_id"]: s for s in rows(store, "SELECT * FROM sessions")}
    assert sessions["kinds"]["turns"] == 5 and sessions["kinds~fresh1"]["turns"] == 1
    assert sessions["kinds~fresh1"]["source"] == "test:kinds#fresh1"
    assert sessions["kinds"]["pause_s"] == pytest.approx(turns[5]["gap_before_s"])


def test_template_divergence_is_recorded_as_the_lcp(store, monkeypatch):
    """multiturn case 3 through run_session: a template whose generation prompt opens an empty think
    block that history turns do not show makes turn 2's ids diverge at the think block."""
    plain = openai_stub.render

    def render_think(messages, add_generation_prompt):
        return plain(messages, False) + ("<|im_start|>assistant\n<think>\n\n</think>\n\n"
                                         if add_generation_prompt else "")

    monkeypatch.setattr(openai_stub, "render", render_think)
    u1, u2 = {"role": "user", "content": "hi"}, {"role": "user", "content": "more"}
    plan = SessionPlan("think", "test:think", [TurnPlan([u1], REF), TurnPlan([u2], REF, 0.0, "think")])
    state = StubState(ttft_s=0.0, itl_s=0.0, reply_ids=lambda i: encode("hello"))
    with StubServer(state) as srv, httpx.Client() as client, store.writer("r1", "w") as writer:
        run_session(plan, client, srv.url, "m", writer, "r1", "text")
    t = rows(store, "SELECT expected_reusable_tokens AS e, divergence_position AS d FROM turns WHERE turn_index = 1")
    # render([u1]) is 10 ids (<|im_start|> u s e r \n h i <|im_end|> \n), the header 11 more
    assert t == [{"e": 21, "d": 21}]


# ----------------------------------------------------------------------------------- Locust


def _mixed_plans(sessions: int, scale: float, token_scale: float):
    w = load_workload("mixed")
    synth = TextSynth(LocalTokenizer(embedded_tokenizer.tokenizer_json()), seed=w.seed)
    return plan_workload(w, synth, time_scale=scale, sessions=sessions, token_scale=token_scale)


def test_locust_distributed_mixed_workload_stores_every_sent_turn_once(store):
    """1 master + 2 workers play the mixed workload: sent == stored, each turn with its kind and gap."""
    n, scale, tscale = 6, 0.001, 0.1
    planned = _mixed_plans(n, scale, tscale)
    state = StubState(ttft_s=0.005, itl_s=0.001)
    run_id = "mixed-dist"
    port = str(_free_port())
    common = ["--turnscope-store", str(store.root), "--turnscope-run-id", run_id, "--turnscope-workload", "mixed",
              "--turnscope-sessions", str(n), "--turnscope-time-scale", str(scale),
              "--turnscope-token-scale", str(tscale), "--turnscope-tokenizer",
              str(embedded_tokenizer.tokenizer_json()), "--turnscope-max-prompt-tokens", "100000000"]
    with StubServer(state) as srv:
        t0 = time.time()
        master = subprocess.Popen(
            _locust_cmd("--master", "--master-bind-host", "127.0.0.1", "--master-bind-port", port,
                        "--expect-workers", "2", "--headless", "-u", "4", "-r", "4", "--run-time", "400s",
                        "--host", srv.url, *common),
            cwd=REPO, env=_locust_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        workers = [subprocess.Popen(
            _locust_cmd("--worker", "--master-host", "127.0.0.1", "--master-port", port),
            cwd=REPO, env=_locust_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for _ in range(2)]
        try:
            out, _ = master.communicate(timeout=450)
            wouts = [w.communicate(timeout=30)[0] for w in workers]
        finally:
            for p in (master, *workers):
                if p.poll() is None:
                    p.kill()
    assert master.returncode == 0, out[-3000:]
    assert all(w.returncode == 0 for w in workers), "\n".join(o[-1500:] for o in wouts)
    assert f"all {len(planned)} sessions played" in out

    turns = rows(store, f"SELECT * FROM turns WHERE run_id = '{run_id}'")
    sent = len([r for r in state.requests if r["path"].endswith("completions")])
    planned_requests = sum(len(p.turns) for p in planned)
    assert sent == len(turns) == planned_requests                    # count sent == count stored
    keys = [(t["session_id"], t["turn_index"]) for t in turns]
    assert len(set(keys)) == len(keys)                               # each exactly once
    assert len({t["request_id"] for t in turns}) == len(turns)
    assert all(t["kind"] is not None and t["gap_kind"] is not None and t["gap_before_s"] is not None
               for t in turns)
    assert all(t["status"] == "ok" for t in turns)
    # each session's turns, in order, have the planned kind and gap kind; fresh requests have their own id
    by_session: dict[str, list] = {}
    for t in sorted(turns, key=lambda t: (t["session_id"], t["turn_index"])):
        by_session.setdefault(t["session_id"], []).append(t)
    for p in planned:
        own = [(tp.kind, tp.gap_kind) for tp in p.turns if tp.kind != "fresh"]
        assert [(t["kind"], t["gap_kind"]) for t in by_session[p.session_id]] == own, p.session_id
        for k, tp in enumerate(p.turns):
            if tp.kind == "fresh":
                (f,) = by_session[f"{p.session_id}~fresh{k}"]
                assert (f["kind"], f["turn_index"]) == ("fresh", 0)
        # measured gaps are at least the planned ones (scaled)
        stored = iter(by_session[p.session_id])
        for tp in p.turns:
            if tp.kind != "fresh":
                assert next(stored)["gap_before_s"] >= tp.gap_before_s - 1e-6
    assert Counter(t["kind"] for t in turns) == Counter(tp.kind for p in planned for tp in p.turns)
    # trace sessions start no earlier than their (scaled) arrival offsets after the test start
    starts = {t["session_id"]: t["sent_at"].timestamp() for t in turns if t["turn_index"] == 0}
    for p in planned:
        if p.start_at_s is not None:
            assert starts[p.session_id] >= t0 + p.start_at_s - 0.05
    (run,) = rows(store, f"SELECT status, workload, workload_spec FROM runs WHERE run_id = '{run_id}'")
    assert (run["status"], run["workload"]) == ("complete", "mixed")
    assert '"time_scale": 0.001' in run["workload_spec"].replace(" ", "").replace(":", ": ")
    shards = list((store.root / "runs" / run_id / "turns").glob("*.parquet"))
    assert len({s.name.rsplit("-", 2)[0] for s in shards}) == 2       # both workers wrote rows


def test_locust_timeout_is_a_failed_turn_with_its_reason(store):
    state = StubState(ttft_s=1.0, itl_s=0.0)
    with StubServer(state) as srv:
        proc = subprocess.run(
            _locust_cmd("--headless", "-u", "1", "-r", "1", "--run-time", "60s", "--host", srv.url,
                        "--turnscope-store", str(store.root), "--turnscope-run-id", "to",
                        "--turnscope-sessions", "1", "--turnscope-max-turns", "2", "--turnscope-gap-s", "0",
                        "--turnscope-timeout-s", "0.3", "--turnscope-max-prompt-tokens", "100000"),
            cwd=REPO, env=_locust_env(), capture_output=True, text=True, timeout=120, check=False)
    out = proc.stdout + proc.stderr
    turns = rows(store, "SELECT status, error, ttft_s, e2e_s FROM turns ORDER BY turn_index")
    assert [t["status"] for t in turns] == ["timeout", "timeout"], out[-2000:]
    assert all("timeout 0.3 s" in t["error"] and t["ttft_s"] is None and 0.25 < t["e2e_s"] < 0.9 for t in turns)
    assert "timeout: " in out and "ReadTimeout" in out               # Locust's failure table names the reason
    assert proc.returncode == 1                                      # Locust: the run had failures


def test_locust_web_ui_serves_and_quits_when_every_session_is_played(store):
    state = StubState(ttft_s=0.01, itl_s=0.001)
    port = _free_port()
    with StubServer(state) as srv:
        proc = subprocess.Popen(
            _locust_cmd("--web-host", "127.0.0.1", "--web-port", str(port), "--autostart", "--autoquit", "1",
                        "-u", "1", "-r", "1", "--host", srv.url, "--turnscope-store", str(store.root),
                        "--turnscope-run-id", "ui", "--turnscope-sessions", "2", "--turnscope-max-turns", "2",
                        "--turnscope-gap-s", "0.5", "--turnscope-max-prompt-tokens", "100000"),
            cwd=REPO, env=_locust_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            page = None
            for _ in range(100):
                try:
                    page = httpx.get(f"http://127.0.0.1:{port}/", timeout=2)
                    break
                except httpx.HTTPError:
                    time.sleep(0.1)
            out, _ = proc.communicate(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert page is not None and page.status_code == 200 and "locust" in page.text.lower()
    assert proc.returncode == 0, out[-2000:]
    assert len(rows(store, "SELECT * FROM turns WHERE run_id = 'ui'")) == 4 == len(state.requests)


def test_locust_replays_a_claude_code_trace_with_sub_agents(store, tmp_path):
    """kv-cache-tester trace_0277 (a parent and 4 sub-agents, 53 requests) through Locust against the
    stub: one session per agent, the trace's reusable tokens per turn (plain-json walk, x 0.02),
    sub-agents running while the parent's session is open; then `turnscope traffic` on the store
    reads the run back as traffic (5 sessions, 53 requests, the sub-agents overlapping the parent)."""
    import itertools
    import json

    from loadgen.traces.kv_cache_tester import DEFAULT_DIR
    from loadgen.traffic import build_report
    from tests.unit.test_agent_traces import naive_common, walk

    trace = DEFAULT_DIR / "trace_0277.json"
    wf = tmp_path / "kv.yaml"
    wf.write_text(f"name: kv-0277\nsessions: 0\ntraces:\n  - {{format: kv_cache_tester, path: {trace}, "
                  f"token_scale: 0.02, time_scale: 0.004}}\n")
    with StubServer(StubState(ttft_s=0.01, itl_s=0.0)) as srv:
        proc = subprocess.run(
            _locust_cmd("--headless", "-u", "5", "-r", "5", "--run-time", "120s", "--host", srv.url,
                        "--turnscope-store", str(store.root), "--turnscope-run-id", "kv",
                        "--turnscope-workload", str(wf), "--turnscope-max-prompt-tokens", "100000",
                        "--turnscope-tokenizer", str(embedded_tokenizer.tokenizer_json())),
            cwd=REPO, env=_locust_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    sessions: list[list[dict]] = []
    walk(json.loads(trace.read_text())["requests"], sessions)
    want = sorted([0] + [round(min(b["in"], 64 * naive_common(a["hash_ids"], b["hash_ids"])) * 0.02)
                         for a, b in itertools.pairwise(s)] for s in sessions)
    turns = rows(store, "SELECT session_id, turn_index, trace_reusable_tokens, sent_at, e2e_s FROM turns "
                        "WHERE run_id = 'kv' ORDER BY session_id, turn_index")
    got: dict[str, list[int]] = {}
    for t in turns:
        got.setdefault(t["session_id"], []).append(t["trace_reusable_tokens"])
    assert sorted(got.values()) == want
    srcs = {r["source"] for r in rows(store, "SELECT source FROM sessions WHERE run_id = 'kv'")}
    assert srcs == {"kv-cache-tester:trace_0277/trace_0277"} | {
        f"kv-cache-tester:trace_0277/trace_0277/agent_00{i}" for i in range(1, 5)}
    rep = build_report(store, [store.root], format="run")
    assert (rep.summary["sessions"], rep.summary["requests"]) == (5, 53)
    assert rep.overlap["overlapping_sessions"] == 5  # every sub-agent ran while the parent's session was open
