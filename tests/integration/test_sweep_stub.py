"""`turnscope sweep` through the command, run_eval's per-mode runs, real Locust processes and the
store, with the workers replaced by the local OpenAI-compatible stub (no vLLM): the orchestration
and the recording of a sweep, checked against what the stub received and the plan's numbers.

Truths: the stub's request log (every body, in order), the embedded tokenizer the text is
synthesized for (a text of N tokens counts N tokens with it), the workload file written here, and
the starts of the (fake) worker stack counted here.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import ClassVar

import duckdb
import pytest
import yaml
from typer.testing import CliRunner

from loadgen.synth_text import LocalTokenizer
from serving.stack import StackAccess
from tests.embedded_tokenizer import tokenizer_json
from tests.integration.openai_stub import StubServer, StubState
from turnscope.commands.app import LOG_DIR, app
from turnscope.conductor import evaluation

REPO = Path(__file__).resolve().parents[2]
SESSIONS, TURNS, VALUES, MODES = 2, 2, (60, 120), ("pd-nocache", "pd-bidir")


class FakeStack(StackAccess):
    """Stands in for serving.stack.ModeStack: the stub is every mode's proxy; starts are counted."""

    starts: ClassVar[list[str]] = []
    url = ""

    def __init__(self, mode, topology, log_dir, kv_bytes_per_token=None, progress=None):
        self.mode = mode
        self.topology = topology
        self.proxy_url = self.url

    def __enter__(self):
        FakeStack.starts.append(self.mode)
        return self

    def __exit__(self, *exc):
        return None

    def endpoints(self):
        return []

    def topology_row(self):
        return {"mode": self.mode, "workers": []}


@pytest.fixture
def logs():
    """The command writes its point files and Locust logs under data/runs/_logs: removed after."""
    yield
    shutil.rmtree(LOG_DIR / "sweeps" / "stub-sweep", ignore_errors=True)
    for f in LOG_DIR.glob("stub-sweep-*-locust.log"):
        f.unlink()


def test_sweep_command_records_one_run_per_mode_and_point(tmp_path, monkeypatch, logs):
    doc = yaml.safe_load((REPO / "data" / "workloads" / "vendor-sweep.yaml").read_text())
    doc["sessions"] = SESSIONS
    doc["mix"][0]["archetype"] |= {"turns": TURNS, "new_tokens": {"think": 30}, "output_tokens": 4}
    doc["sweep"]["settle_s"] = 0.1
    wl = tmp_path / "vendor-sweep.yaml"
    wl.write_text(yaml.safe_dump(doc))
    topo = yaml.safe_load((REPO / "data" / "topologies" / "embedded-cpu.yaml").read_text())
    (tmp_path / "model").mkdir()  # the text is synthesized for the embedded tokenizer (whole-word tokens)
    shutil.copy(tokenizer_json(), tmp_path / "model" / "tokenizer.json")
    topo["model"] = str(tmp_path / "model")
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump(topo))
    store = tmp_path / "store"

    state = StubState(ttft_s=0.01, itl_s=0.0)
    with StubServer(state) as srv:
        FakeStack.url, FakeStack.starts = srv.url, []
        monkeypatch.setattr(evaluation, "ModeStack", FakeStack)
        r = CliRunner().invoke(app, ["sweep", "--workload", str(wl), "--topology", str(tmp_path / "topo.yaml"),
                                     "--store", str(store), "--modes", ",".join(MODES), "--histories", "text",
                                     "--values", ",".join(map(str, VALUES)), "--sweep-id", "stub-sweep"],
                               env={"COLUMNS": "4000"})
    out = " ".join(r.output.split())
    assert r.exit_code == 0, out
    assert FakeStack.starts == list(MODES)  # one start per mode, every point on it

    con = duckdb.connect(str(store / "turnscope.duckdb"), read_only=True)
    points = con.execute("SELECT run_id, mode, prefix_tokens, point_index, sweep_id, sweep_scale, swept_field, "
                         "sessions, users, status FROM sweep_points ORDER BY mode DESC, prefix_tokens").fetchall()
    assert points == [(f"stub-sweep-{m}-text-p{v}", m, v, i, "stub-sweep", "default", "first_prompt_tokens",
                       SESSIONS, 2, "complete") for m in MODES for i, v in enumerate(VALUES)]
    spec = dict(con.execute("SELECT run_id, workload_spec FROM runs").fetchall())
    for m in MODES:
        for v in VALUES:
            s = yaml.safe_load(spec[f"stub-sweep-{m}-text-p{v}"])  # JSON is YAML
            assert s["sweep"]["values"] == list(VALUES) and s["sessions"] == SESSIONS and s["users"] == 2
            assert s["workload"]["mix"][0]["archetype"]["first_prompt_tokens"] == {"kind": "constant", "value": v}
            assert Path(s["file"]).name == "vendor-sweep.yaml" and f"p{v}" in s["file"]
    counts = dict(con.execute("SELECT run_id, count(*) FROM turns WHERE status = 'ok' GROUP BY run_id").fetchall())
    assert counts == {f"stub-sweep-{m}-text-p{v}": SESSIONS * TURNS for m in MODES for v in VALUES}
    con.close()

    # What the stub received for each run: the shared 64-token system prompt (the same text in every
    # conversation), each conversation's own first message of exactly the point's tokens, then
    # 30-token user turns (counted with the tokenizer they were synthesized for).
    tok = LocalTokenizer(tokenizer_json())
    for m in MODES:
        for v in VALUES:
            run_id = f"stub-sweep-{m}-text-p{v}"
            reqs = [q for q in state.requests if str(q.get("conversation_id", "")).startswith(run_id + "/")]
            assert len(reqs) == SESSIONS * TURNS
            firsts = [q["messages"] for q in reqs if len(q["messages"]) == 2]
            assert len(firsts) == SESSIONS
            assert {f[0]["role"] for f in firsts} == {"system"} and len({f[0]["content"] for f in firsts}) == 1
            assert tok.count([f[0]["content"] for f in firsts]) == [64] * SESSIONS
            assert tok.count([f[1]["content"] for f in firsts]) == [v] * SESSIONS
            assert len({f[1]["content"] for f in firsts}) == SESSIONS
            later = [q["messages"][-1]["content"] for q in reqs if len(q["messages"]) > 2]
            assert tok.count(later) == [30] * SESSIONS * (TURNS - 1)
            assert {q["cache_salt"] for q in reqs} == {run_id}  # each point its own prefix cache
    # The summary at the end: a row per (point, mode), so it fits 80 columns; the stub reports every
    # later turn of a conversation as a hit (2 of the 2 later turns per point), and there is no P to
    # scrape (0 external tokens).
    assert "Sweep, history text: TTFT mean / p90 (ms) by prefix tokens" in out
    rows = re.findall(r"│ (\d*) ?│ (pd-[a-z-]+) │ \d+ / \d+ │ (\d+/\d+) │ (\d+) │", out)
    assert rows == [("60", "pd-nocache", "2/2", "0"), ("", "pd-bidir", "2/2", "0"),
                    ("120", "pd-nocache", "2/2", "0"), ("", "pd-bidir", "2/2", "0")], out
