"""`turnscope eval` with the interleaved schedule (turnscope/conductor/schedule.py) through the command,
run_eval, real Locust processes (one per slice) and the store, each mode's workers replaced by a
local OpenAI-compatible stub of its own. Truths: each stub's own log of the requests it served
(which run and session, when), and the order the seed draws (random.shuffle, redone here)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import ClassVar

import duckdb
import yaml
from typer.testing import CliRunner

from serving.stack import StackAccess
from tests.embedded_tokenizer import tokenizer_json
from tests.integration.openai_stub import StubServer, StubState
from turnscope.commands.app import LOG_DIR, app
from turnscope.conductor import evaluation

REPO = Path(__file__).resolve().parents[2]
#: Three two-turn sessions of short prompts (the stub answers at once).
WORKLOAD = {"name": "il-stub", "seed": 1, "sessions": 3, "mix": [{"weight": 1, "archetype": {
    "name": "tiny", "turns": 2, "first_prompt_tokens": 30, "new_tokens": {"think": 10}, "output_tokens": 4,
    "gaps": {"think": {"p": 1.0, "seconds": 0.0}}}}]}


class StubStack(StackAccess):
    """Stands in for serving.stack.ModeStack: mode -> its own stub (its proxy and prefill worker);
    launches and readiness are recorded with the proxy port each stack was given."""

    urls: ClassVar[dict[str, str]] = {}
    events: ClassVar[list[tuple]] = []

    def __init__(self, mode, topology, log_dir, kv_bytes_per_token=None, progress=None):
        self.mode, self.topology, self.proxy_url = mode, topology, self.urls[mode]
        self.workers = []  # no vLLM worker to watch while the stacks start (serving.workers.wait_all_healthy)

    def launch(self):
        StubStack.events.append(("launch", self.mode, self.topology.proxy.port))

    def ready(self, timeout_scale=1.0):
        StubStack.events.append(("ready", self.mode, timeout_scale))

    def serve(self, timeout_scale=1.0):
        StubStack.events.append(("serve", self.mode, timeout_scale))
        return self

    def __exit__(self, *exc):
        StubStack.events.append(("stop", self.mode))

    def endpoints(self):
        return [(self.proxy_url, "prefill")]

    def topology_row(self):
        return {"mode": self.mode, "workers": []}


def test_eval_interleaves_the_compared_modes_in_seeded_rounds(tmp_path, monkeypatch):
    topo = yaml.safe_load((REPO / "data" / "topologies" / "embedded-cpu.yaml").read_text())
    (tmp_path / "model").mkdir()  # the text is synthesized for the embedded tokenizer
    shutil.copy(tokenizer_json(), tmp_path / "model" / "tokenizer.json")
    topo["model"] = str(tmp_path / "model")
    (tmp_path / "wl.yaml").write_text(yaml.safe_dump(WORKLOAD))
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump(topo))
    store = tmp_path / "store"
    with StubServer(StubState(ttft_s=0.02, itl_s=0.0)) as a, StubServer(StubState(ttft_s=0.02, itl_s=0.0)) as b:
        StubStack.urls, StubStack.events = {"pd": a.url, "pd-bidir": b.url}, []
        monkeypatch.setattr(evaluation, "ModeStack", StubStack)
        r = CliRunner().invoke(app, ["eval", "--topology", str(tmp_path / "topo.yaml"), "--store", str(store),
                                     "--modes", "pd,pd-bidir", "--histories", "text", "--sessions", "3",
                                     "--workload", str(tmp_path / "wl.yaml"),
                                     "--users", "1", "--max-turns", "2", "--gap-s", "0", "--label", "stub-il",
                                     "--schedule-seed", "5"], env={"COLUMNS": "4000"})
        # (conversation "<run_id>/<session_id>", when the stub finished answering), warm-up's left out
        served = {mode: [(srv.state.requests[i]["conversation_id"], t) for i, t in srv.state.finished
                         if "/" in (srv.state.requests[i].get("conversation_id") or "")]
                  for mode, srv in (("pd", a), ("pd-bidir", b))}
    for f in LOG_DIR.glob("stub-il-*-locust.log"):
        f.unlink()
    shutil.rmtree(tmp_path / "model")
    out = " ".join(r.output.split())
    assert r.exit_code == 0, out
    # both stacks launched before either was waited on, on ports of their own; stopped at the end
    launches = [e for e in StubStack.events if e[0] == "launch"]
    assert [e[:2] for e in StubStack.events[:6]] == [(step, m) for step in ("launch", "ready", "serve")
                                                     for m in ("pd", "pd-bidir")]
    assert launches[0][2] == topo["proxy"]["port"]
    assert launches[0][2] != launches[1][2]
    assert sorted(e[1] for e in StubStack.events if e[0] == "stop") == ["pd", "pd-bidir"]
    con = duckdb.connect(str(store / "turnscope.duckdb"), read_only=True)
    runs = dict(con.execute("SELECT mode, run_id FROM runs").fetchall())
    specs = {m: json.loads(s) for m, s in con.execute(
        "SELECT mode, json_extract(workload_spec, '$.schedule')::VARCHAR FROM runs").fetchall()}
    stored = dict(con.execute("SELECT run_id, list(DISTINCT session_id ORDER BY session_id) FROM turns "
                              "GROUP BY run_id").fetchall())
    con.close()
    # each mode's stub served its own run only, every session of it: the same sessions as one go plays
    for mode, reqs in served.items():
        assert {c.split("/")[0] for c, _ in reqs} == {runs[mode]}
        assert sorted({c.split("/")[1] for c, _ in reqs}) == stored[runs[mode]]
        assert len(stored[runs[mode]]) == 3
    # the order the seed draws, round by round (one session per round: --users 1)
    rng, orders = random.Random(5), []
    for _ in range(3):
        o = ["pd", "pd-bidir"]
        rng.shuffle(o)
        orders.append(o)
    assert specs["pd"]["orders"] == orders and specs["pd"]["seed"] == 5 and specs["pd"]["rounds"] == 3
    assert specs["pd"]["slices"] == [[0, 1], [1, 2], [2, 3]]
    # ...and the order the stubs saw: the runs' sessions alternate as drawn
    seen = sorted((t, mode, c.split("/")[1]) for mode, reqs in served.items() for c, t in reqs)
    played = list(dict.fromkeys((mode, s) for _, mode, s in seen))
    ids = stored[runs["pd"]]  # the same three sessions in both runs, in plan order
    assert stored[runs["pd-bidir"]] == ids
    assert played == [(m, ids[k]) for k, o in enumerate(orders) for m in o]
    assert "Interleaved: pd, pd-bidir up together, sessions in 3 round(s) per history mode" in out
    assert "(seed 5)" in out
