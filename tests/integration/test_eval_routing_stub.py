"""`turnscope eval --prefill-routing round-robin,session` through the command, run_eval, real Locust
processes and the store, the workers replaced by the local OpenAI-compatible stub: each mode's
workers start once, the proxy is restarted for the second policy, and each run records the policy
it ran with. Truths: the starts and restarts counted here, and the policies given on the command
line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import ClassVar

import duckdb
import yaml
from typer.testing import CliRunner

from serving.stack import StackAccess
from tests.integration.openai_stub import StubServer, StubState
from turnscope.commands.app import LOG_DIR, app
from turnscope.conductor import evaluation

REPO = Path(__file__).resolve().parents[2]


class RoutingStack(StackAccess):
    """Stands in for serving.stack.ModeStack: the stub is every mode's proxy; starts and proxy
    restarts are recorded."""

    events: ClassVar[list[tuple[str, str]]] = []
    url = ""

    def __init__(self, mode, topology, log_dir, kv_bytes_per_token=None, progress=None):
        self.mode, self.topology, self.proxy_url = mode, topology, self.url

    def __enter__(self):
        RoutingStack.events.append(("start", self.mode, self.topology.proxy.prefill_routing))
        return self

    def __exit__(self, *exc):
        return None

    def restart_proxy(self, prefill_routing):
        proxy = self.topology.proxy.model_copy(update={"prefill_routing": prefill_routing})
        self.topology = self.topology.model_copy(update={"proxy": proxy})
        RoutingStack.events.append(("restart", self.mode, prefill_routing))

    def endpoints(self):
        return []

    def topology_row(self):
        return {"mode": self.mode, "workers": []}


def test_eval_runs_each_routing_policy_on_the_same_workers(tmp_path, monkeypatch):
    topo = yaml.safe_load((REPO / "data" / "topologies" / "embedded-cpu-2p1d.yaml").read_text())
    (tmp_path / "model").mkdir()
    topo["model"] = str(tmp_path / "model")
    # not the defaults (480 s, 30 s): run_config must read them from where eval records them
    topo.setdefault("connector", {})["decoder_kv_blocks_ttl"] = 120
    topo.setdefault("proxy", {})["handle_ttl_margin_s"] = 12.0
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump(topo))
    store = tmp_path / "store"
    with StubServer(StubState(ttft_s=0.01, itl_s=0.0)) as srv:
        RoutingStack.url, RoutingStack.events = srv.url, []
        monkeypatch.setattr(evaluation, "ModeStack", RoutingStack)
        r = CliRunner().invoke(app, ["eval", "--topology", str(tmp_path / "topo.yaml"), "--store", str(store),
                                     "--modes", "pd,pd-bidir", "--histories", "text", "--sessions", "1",
                                     "--max-turns", "2", "--gap-s", "0", "--label", "stub-routing",
                                     "--prefill-routing", "round-robin,session"], env={"COLUMNS": "4000"})
    for f in LOG_DIR.glob("stub-routing-*-locust.log"):
        f.unlink()
    shutil.rmtree(tmp_path / "model")
    out = " ".join(r.output.split())
    assert r.exit_code == 0, out
    # the file says session; the first policy given replaces it at the start, the second restarts the proxy
    assert RoutingStack.events == [("start", "pd", "round-robin"), ("restart", "pd", "session"),
                                   ("start", "pd-bidir", "round-robin"), ("restart", "pd-bidir", "session")]
    con = duckdb.connect(str(store / "turnscope.duckdb"), read_only=True)
    rows = con.execute("SELECT r.run_id, r.mode, c.prefill_routing, c.decode_routing, r.config FROM runs r "
                       "JOIN run_config c USING (run_id) ORDER BY r.started_at").fetchall()
    ttls = con.execute("SELECT DISTINCT decoder_kv_blocks_ttl_s, handle_ttl_margin_s FROM run_config").fetchall()
    con.close()
    assert ttls == [(120.0, 12.0)]
    assert [(m, p, d) for _, m, p, d, _ in rows] == [
        ("pd", "round-robin", "session"), ("pd", "session", "session"),
        ("pd-bidir", "round-robin", "session"), ("pd-bidir", "session", "session")]
    assert [run_id.rsplit("-text-", 1)[1] for run_id, *_ in rows] == ["pround-robin", "psession"] * 2
    assert [json.loads(c)["operator_config"]["prefill_routing"] for *_, c in rows] == \
        ["round-robin", "session"] * 2
