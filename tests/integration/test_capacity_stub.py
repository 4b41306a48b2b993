"""`turnscope capacity` through the command, run_eval's per-mode runs, real Locust processes and the
store, with the workers replaced by the local OpenAI-compatible stub (no vLLM): the ramp's wiring.

Truths: the stub's request log (every body, in order), its injected delays (TTFT 30 ms, ITL 20 ms,
both inside the SLO given here), the steps and sizes given on the command line, and the topology
each (fake) worker stack was started with, recorded here.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import ClassVar

import duckdb
import pytest
import yaml
from typer.testing import CliRunner

from serving.stack import StackAccess
from tests.embedded_tokenizer import tokenizer_json
from tests.integration.openai_stub import StubServer, StubState
from turnscope.commands.app import LOG_DIR, app
from turnscope.conductor import evaluation

pytestmark = pytest.mark.timing

REPO = Path(__file__).resolve().parents[2]
USERS, PER_USER, TURNS, MODES = (1, 2), 2, 2, ("pd", "pd-bidir")
TTFT_S, ITL_S = 0.03, 0.02


class FakeStack(StackAccess):
    """Stands in for serving.stack.ModeStack: the stub is every mode's proxy; starts are recorded
    with the topology they were given."""

    starts: ClassVar[list[tuple[str, object]]] = []
    url = ""

    def __init__(self, mode, topology, log_dir, kv_bytes_per_token=None, progress=None):
        self.mode, self.topology = mode, topology
        self.proxy_url = self.url

    def __enter__(self):
        FakeStack.starts.append((self.mode, self.topology))
        return self

    # serving.stack.started_together's protocol (the interleaved schedule): launch, ready, serve
    workers: ClassVar[list] = []

    def launch(self):
        FakeStack.starts.append((self.mode, self.topology))

    def ready(self, timeout_scale=1.0):
        return None

    def serve(self, timeout_scale=1.0):
        return self

    def __exit__(self, *exc):
        return None

    def endpoints(self):
        return []

    def topology_row(self):
        return {"mode": self.mode, "workers": []}


@pytest.fixture
def logs():
    yield
    for f in LOG_DIR.glob("stub-cap-*-locust.log"):
        f.unlink()


@pytest.mark.parametrize("schedule", ["sequential", "interleaved"])
def test_capacity_command_records_one_run_per_mode_and_step(tmp_path, monkeypatch, logs, schedule):
    doc = yaml.safe_load((REPO / "data" / "workloads" / "capacity.yaml").read_text())
    doc["mix"][0]["archetype"] |= {"turns": TURNS, "system_prompt_tokens": 20, "first_prompt_tokens": 10,
                                   "new_tokens": {"tool": 10}, "output_tokens": 4,
                                   "gaps": {"tool": {"p": 1.0, "seconds": 0.05}}}
    wl = tmp_path / "capacity.yaml"
    wl.write_text(yaml.safe_dump(doc))
    topo = yaml.safe_load((REPO / "data" / "topologies" / "embedded-cpu.yaml").read_text())
    (tmp_path / "model").mkdir()
    shutil.copy(tokenizer_json(), tmp_path / "model" / "tokenizer.json")
    topo["model"] = str(tmp_path / "model")
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump(topo))
    store = tmp_path / "store"

    state = StubState(ttft_s=TTFT_S, itl_s=ITL_S)
    with StubServer(state) as srv:
        FakeStack.url, FakeStack.starts = srv.url, []
        monkeypatch.setattr(evaluation, "ModeStack", FakeStack)
        r = CliRunner().invoke(app, ["capacity", "--workload", str(wl), "--topology", str(tmp_path / "topo.yaml"),
                                     "--store", str(store), "--users", ",".join(map(str, USERS)),
                                     "--sessions-per-user", str(PER_USER), "--slo-ttft-s", "0.5",
                                     "--slo-tpot-s", "0.05", "--decode-kv-tokens", "9000", "--ttl-s", "40",
                                     "--capacity-id", "stub-cap", "--schedule", schedule], env={"COLUMNS": "4000"})
    out = " ".join(r.output.split())
    assert r.exit_code == 0, out
    assert [m for m, _ in FakeStack.starts] == list(MODES)  # one worker start per mode, every step on it
    if schedule == "interleaved":  # both stacks up together, each on its own ports
        assert len({t.proxy.port for _, t in FakeStack.starts}) == 2
    # the order the runs reached the stub: sequential, one mode's whole ramp then the other's;
    # interleaved, every mode's step i before any mode's step i + 1
    first_seen = list(dict.fromkeys(str(q["conversation_id"]).split("/")[0] for q in state.requests
                                    if str(q.get("conversation_id", "")).startswith("stub-cap-")))
    step_of = {f"stub-cap-{m}-u{u}": i for m in MODES for i, u in enumerate(USERS)}
    if schedule == "sequential":
        assert first_seen == [f"stub-cap-{m}-u{u}" for m in MODES for u in USERS]
    else:
        assert sorted(first_seen) == sorted(step_of) and [step_of[r] for r in first_seen] == [0, 0, 1, 1]
    for _, t in FakeStack.starts:  # D alone gets the small KV space; the plan's TTL reaches the connector
        assert t.roles["decode"].args[-2:] == ["--kv-cache-memory-bytes", str(9000 * 4096)]
        assert "--kv-cache-memory-bytes" not in (t.roles["prefill"].args if "prefill" in t.roles else [])
        assert t.kv_cache_bytes == topo["kv_cache_bytes"]
        assert (t.connector.decoder_kv_blocks_ttl, t.proxy.handle_ttl_margin_s) == (40, 5.0)

    con = duckdb.connect(str(store / "turnscope.duckdb"), read_only=True)
    steps = con.execute("SELECT run_id, mode, step_index, users, sessions, decode_kv_cache_bytes, slo_ttft_s, "
                        "slo_tpot_s, decoder_kv_blocks_ttl_s, status FROM capacity_steps "
                        "ORDER BY mode, users").fetchall()
    assert steps == [(f"stub-cap-{m}-u{u}", m, i, u, u * PER_USER, 9000 * 4096, 0.5, 0.05, 40.0, "complete")
                     for m in MODES for i, u in enumerate(USERS)]
    counts = dict(con.execute("SELECT run_id, count(*) FROM turns WHERE status = 'ok' GROUP BY run_id").fetchall())
    assert con.execute("SELECT min(ttft_s) FROM turns").fetchone()[0] >= TTFT_S  # the stub's injected delay
    con.close()
    for m in MODES:
        for u in USERS:
            rid = f"stub-cap-{m}-u{u}"
            reqs = [q for q in state.requests if str(q.get("conversation_id", "")).startswith(rid + "/")]
            sessions = {q["conversation_id"] for q in reqs}
            assert (len(sessions), len(reqs), counts[rid]) == (u * PER_USER, u * PER_USER * TURNS, u * PER_USER * TURNS)
            assert {q["cache_salt"] for q in reqs} == {rid}  # each step its own prefix cache
    # The summary: every turn met the SLO (the stub's 30 ms TTFT and 20 ms ITL are inside it).
    assert "capacity ramp stub-cap: SLO TTFT <= 500 ms, TPOT <= 50 ms" in out
    for u in USERS:
        n = u * PER_USER * TURNS
        for m in MODES:
            assert f"│ {u} │ {m} │ {n} │ {n} │" in out, (u, m)
    assert "No crossing within the steps measured" in out or "starts to cost capacity" in out


@pytest.mark.parametrize("args, needle", [
    (["--users", "3,2"], "load steps must be strictly ascending integers >= 1, got [3, 2]"),
    (["--users", "1,two"], "--users takes comma-separated integers"),
    (["--decode-kv-tokens", "100"], "--decode-kv-tokens 100 is below max_model_len 8192"),
    (["--prefill-kv-tokens", "100"], "--prefill-kv-tokens 100 is below max_model_len 8192"),
    (["--prefill-kv-tokens", "many"], "--prefill-kv-tokens"),
    (["--slo-ttft-s", "0"], "--slo-ttft-s and --slo-tpot-s must be > 0 seconds"),
    (["--workload", "nope.yaml"], "workload file nope.yaml does not exist"),
])
def test_bad_input_is_a_clear_error_without_traceback(tmp_path, args, needle):
    topo = yaml.safe_load((REPO / "data" / "topologies" / "embedded-cpu.yaml").read_text())
    topo["model"] = str(tmp_path)
    (tmp_path / "topo.yaml").write_text(yaml.safe_dump(topo))
    r = CliRunner().invoke(app, ["capacity", "--topology", str(tmp_path / "topo.yaml"), "--store",
                                 str(tmp_path / "store"), "--dry-run", *args], env={"COLUMNS": "4000"})
    out = " ".join(r.output.split())
    assert r.exit_code == 2 and needle in out and "Traceback" not in out, out
