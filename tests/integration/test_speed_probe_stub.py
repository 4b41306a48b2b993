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

pytestmark = pytest.mark.timing

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
        cached_salts = [q.get("cache_salt") for q in srv.state.requests if q.get("max_tokens") == 1
                        and q["prompt_ids"] == speed_probe.probe_ids(2304)]
    for f in LOG_DIR.glob("stub-probe-*-locust.log"):
        f.unlink()
    shutil.rmtree(tmp_path / "model")
    assert r.exit_code == 0, " ".join(r.output.split())
    con = duckdb.connect(str(store / "turnscope.duckdb"), read_only=True)
    rows = con.execute("SELECT p.run_id, phase, target, endpoint, prompt_tokens, ttft_s, p.status, p.sent_at >= r.started_at "
                       "FROM run_probes p JOIN runs r USING (run_id) ORDER BY phase DESC, p.sent_at").fetchall()
    con.close()
    run_id = rows[0][0]
    # three times at each end (speed_probe.PROBES_PER_PHASE) the short probe, the compute probe, then
    # the cached-prefix probe (the compute probe's 2,048 ids and 256 more)
    assert [(a, t, e, n, s, after) for _, a, t, e, n, _, s, after in rows] == \
        [("start", "prefill", srv.url, n, "ok", True) for _ in range(3) for n in (256, 2048, 2304)] + \
        [("end", "prefill", srv.url, n, "ok", True) for _ in range(3) for n in (256, 2048, 2304)]
    assert speed_probe.probe_ids(2304)[:2048] == speed_probe.probe_ids(2048)
    assert all(DELAY_S <= ttft < DELAY_S + SLACK_S for *_, ttft, _, _ in rows)
    # each probe its own salt: no prefix cache holds the prompt
    assert salts == [f"turnscope-probe-{run_id}-{phase}-{k}" for phase in ("start", "end") for k in range(3)]
    assert long_salts == [f"turnscope-probe-{run_id}-{phase}-{k}-2048" for phase in ("start", "end") for k in range(3)]
    # the cached-prefix probe takes its compute probe's salt: it finds that probe's blocks cached
    assert cached_salts == long_salts


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
    assert [r["prompt_tokens"] for r in rows] == [256, 2048, 2304] * 3 and all(r["status"] == "ok" for r in rows)
    short, diff = probe_ttft_s(store, ["r1"])["r1"], compute_probe_s(store, ["r1"])["r1"]
    assert 0.0756 <= short < 0.0756 + 0.1                # the sleeps are lower bounds; HTTP adds a little
    assert diff == pytest.approx(0.1792, abs=0.03)       # both probes pay the same HTTP round trip


def test_serve_probes_speak_for_the_runs_recorded_through_the_serve(tmp_path):
    """`turnscope serve`'s probes (speed_probe.ServeProbes) at its start and stop, against a stub that
    takes 0.1 s to its first token plus 1e-4 s per prompt token: a Locust run recorded between them has
    no probes of its own and takes the serve's (store.queries.planner_runs); a run recorded before the serve
    started takes none."""
    import datetime as dt

    from serving.handle_check import RELEASE_MAX_TOKENS
    from store.queries.planner_runs import RunProbes, compute_probe_s, path_probe_s, probe_ttft_s, run_probes
    from store.writer import Store

    store = Store(tmp_path / "store")
    store.init()

    def run_row(run_id: str, start: dt.datetime, end: dt.datetime) -> None:
        with store.writer(run_id, "locust") as w:
            w.append("runs_log", {"run_id": run_id, "mode": "pd-bidir", "started_at": start, "finished_at": end,
                                  "updated_at": end, "status": "complete"})

    before = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    run_row("earlier", before, before + dt.timedelta(minutes=1))
    with StubServer(StubState(ttft_s=0.1, itl_s=0.0, prefill_s_per_token=1e-4)) as srv, \
            StubServer(StubState(ttft_s=0.3, itl_s=0.0, prefill_s_per_token=1e-4)) as proxy, \
            speed_probe.ServeProbes(store, [(srv.url, "prefill"), (proxy.url, "proxy")], "stub") as probes:
        now = dt.datetime.now(dt.UTC)
        run_row("through-serve", now, now + dt.timedelta(milliseconds=10))
    path_asks = [q["max_tokens"] for q in proxy.state.requests]
    assert probes.run_id.startswith("serve-probes-")
    # three rounds of 256, 2,048 and 2,304 tokens on the worker, each followed by the path probe
    # (256 tokens through the proxy), at each end
    assert [(r["phase"], r["target"], r["prompt_tokens"]) for r in probes.rows] == \
        [(phase, t, n) for phase in ("start", "end") for _ in range(3)
         for t, n in (("prefill", 256), ("prefill", 2048), ("prefill", 2304), ("proxy", 256))]
    # the path probe asks for more than one token and leaves after the first (a release turn's ask)
    assert path_asks == [RELEASE_MAX_TOKENS] * 6
    short = probe_ttft_s(store, ["earlier", "through-serve"])
    assert list(short) == ["through-serve"]
    assert 0.1 + 256e-4 <= short["through-serve"] < 0.1 + 256e-4 + SLACK_S   # the stub's delay is a floor
    # the compute of 1,792 tokens at 1e-4 s each, both probes paying the same round trip
    assert compute_probe_s(store, ["through-serve"])["through-serve"] == pytest.approx(0.1792, abs=0.05)
    # the path probe reads the proxy stub's own delay, apart from the worker's short probe
    through = path_probe_s(store, ["earlier", "through-serve"])
    assert list(through) == ["through-serve"]
    assert 0.3 + 256e-4 <= through["through-serve"] < 0.3 + 256e-4 + SLACK_S
    # the one reader the planner takes: each probe as read above (2,304 - 256 tokens of compute for the
    # cached-prefix probe: the stub keeps no cache); the earlier run, recorded before the serve, has none
    both = run_probes(store, ["earlier", "through-serve"])
    assert both["earlier"] == RunProbes()
    assert both["through-serve"][:2] == (short["through-serve"], compute_probe_s(store, ["through-serve"])["through-serve"])
    assert both["through-serve"].path_s == through["through-serve"]
    assert both["through-serve"].cached_s == pytest.approx(0.2048, abs=0.05)
