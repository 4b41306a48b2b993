"""The speed probe (turnscope/conductor/speed_probe.py) against the local OpenAI-compatible stub, whose time to
first token is injected: the probe alone, and `turnscope eval` recording a probe at each run's start
and end in ``run_probes``. Truths: the injected delay and the stub's own log of requests."""

from __future__ import annotations

import shutil
from pathlib import Path

import duckdb
import pytest
import yaml
from typer.testing import CliRunner

from serving.stack import StackAccess
from tests.integration.openai_stub import StubServer, StubState
from turnscope.commands.app import LOG_DIR, app
from turnscope.conductor import evaluation, speed_probe

REPO = Path(__file__).resolve().parents[2]
DELAY_S = 0.2
#: The stub sleeps DELAY_S before its first token: the probe cannot be faster, and on a loaded
#: 2-core machine is at most this much slower.
SLACK_S = 1.0


def test_probe_measures_the_time_to_the_first_token():
    with StubServer(StubState(ttft_s=DELAY_S, itl_s=0.0)) as srv:
        row = speed_probe.probe(srv.url, "stub", salt="s1")
        sent = srv.state.requests
    assert row["status"] == "ok" and row["error"] is None
    assert DELAY_S <= row["ttft_s"] < DELAY_S + SLACK_S
    body = sent[0]
    assert body["prompt_ids"] == speed_probe.probe_ids() and len(body["prompt_ids"]) == 256
    assert (body["max_tokens"], body["cache_salt"], body["stream"]) == (1, "s1", True)


def test_probe_failure_is_a_row_not_an_exception():
    with StubServer(StubState(fail_requests={0})) as srv:
        row = speed_probe.probe(srv.url, "stub", salt="x")
    assert row["status"] == "error" and row["ttft_s"] is None and "500" in row["error"]


def test_probe_target_prefers_the_prefill_worker():
    eps = [("http://d", "decode"), ("http://p", "prefill"), ("http://x", "proxy")]
    assert speed_probe.probe_target(eps) == ("http://p", "prefill")
    assert speed_probe.probe_target([("http://a", "aggregated")]) == ("http://a", "aggregated")
    assert speed_probe.probe_target([("http://x", "proxy")]) is None


class ProbeStack(StackAccess):
    """Stands in for serving.stack.ModeStack: the stub is the proxy and the prefill worker."""

    url = ""

    def __init__(self, mode, topology, log_dir, kv_bytes_per_token=None, progress=None):
        self.mode, self.topology, self.proxy_url = mode, topology, self.url

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def endpoints(self):
        return [(self.url, "prefill")]

    def topology_row(self):
        return {"mode": self.mode, "workers": []}


def test_eval_records_a_probe_at_each_runs_start_and_end(tmp_path, monkeypatch):
    topo = yaml.safe_load((REPO / "data" / "topologies" / "embedded-cpu-2p1d.yaml").read_text())
    (tmp_path / "model").mkdir()
    topo["model"] = str(tmp_path / "model")
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump(topo))
    store = tmp_path / "store"
    with StubServer(StubState(ttft_s=DELAY_S, itl_s=0.0)) as srv:
        ProbeStack.url = srv.url
        monkeypatch.setattr(evaluation, "ModeStack", ProbeStack)
        r = CliRunner().invoke(app, ["eval", "--topology", str(tmp_path / "topo.yaml"), "--store", str(store),
                                     "--modes", "pd", "--histories", "text", "--sessions", "1",
                                     "--max-turns", "1", "--gap-s", "0", "--label", "stub-probe"],
                               env={"COLUMNS": "4000"})
        salts = [q.get("cache_salt") for q in srv.state.requests if q.get("max_tokens") == 1
                 and q["prompt_ids"] == speed_probe.probe_ids()]
        long_salts = [q.get("cache_salt") for q in srv.state.requests if q.get("max_tokens") == 1
                      and q["prompt_ids"] == speed_probe.probe_ids(2048)]
    for f in LOG_DIR.glob("stub-probe-*-locust.log"):
        f.unlink()
    shutil.rmtree(tmp_path / "model")
    assert r.exit_code == 0, " ".join(r.output.split())
    con = duckdb.connect(str(store / "turnscope.duckdb"), read_only=True)
    rows = con.execute("SELECT p.run_id, phase, target, endpoint, prompt_tokens, ttft_s, p.status, p.sent_at >= r.started_at "
                       "FROM run_probes p JOIN runs r USING (run_id) ORDER BY phase DESC, p.sent_at").fetchall()
    con.close()
    run_id = rows[0][0]
    # three times at each end (speed_probe.PROBES_PER_PHASE) the short probe, then the compute probe
    assert [(a, t, e, n, s, after) for _, a, t, e, n, _, s, after in rows] == \
        [("start", "prefill", srv.url, n, "ok", True) for _ in range(3) for n in (256, 2048)] + \
        [("end", "prefill", srv.url, n, "ok", True) for _ in range(3) for n in (256, 2048)]
    assert all(DELAY_S <= ttft < DELAY_S + SLACK_S for *_, ttft, _, _ in rows)
    # each probe its own salt: no prefix cache holds the prompt
    assert salts == [f"turnscope-probe-{run_id}-{phase}-{k}" for phase in ("start", "end") for k in range(3)]
    assert long_salts == [f"turnscope-probe-{run_id}-{phase}-{k}-2048" for phase in ("start", "end") for k in range(3)]


@pytest.mark.parametrize("tokens", [1, 256, 4096])
def test_probe_ids_are_fixed(tokens):
    assert speed_probe.probe_ids(tokens) == speed_probe.probe_ids(tokens) and len(speed_probe.probe_ids(tokens)) == tokens


def test_the_compute_probe_reads_the_compute_alone(tmp_path):
    """Against a stub whose prefill costs 0.1 ms per prompt token on top of a fixed 50 ms: the short
    probe reads 75.6 ms, mostly the fixed cost, and the compute probe less the short one reads the
    injected compute of the 1,792 tokens between them, 179.2 ms (the truth: 1e-4 x 1,792), which
    planner_runs.compute_probe_s returns from the stored rows."""
    from store.queries.planner_runs import compute_probe_s, probe_ttft_s
    from store.writer import Store

    store = Store(tmp_path / "store")
    store.init()
    with StubServer(StubState(ttft_s=0.05, itl_s=0.0, prefill_s_per_token=1e-4)) as srv, \
            store.writer("r1", "test") as w:
        rows = speed_probe.probe_run(w, "r1", "start", [(srv.url, "prefill")], "stub")
    assert [r["prompt_tokens"] for r in rows] == [256, 2048] * 3 and all(r["status"] == "ok" for r in rows)
    short, diff = probe_ttft_s(store, ["r1"])["r1"], compute_probe_s(store, ["r1"])["r1"]
    assert 0.0756 <= short < 0.0756 + 0.1                # the sleeps are lower bounds; HTTP adds a little
    assert diff == pytest.approx(0.1792, abs=0.03)       # both probes pay the same HTTP round trip
