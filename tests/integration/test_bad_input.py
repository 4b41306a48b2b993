"""Bad input: a clear error naming the file, line or field and what was expected, before anything
runs; no run is marked complete, and nothing recorded earlier is lost.

Each case goes through the entry points an operator uses (``turnscope eval`` / ``turnscope serve``
in-process with Typer's runner, and ``locust -f loadgen/locustfile.py`` as a process). The store
used holds a finished run beforehand; after each case it holds exactly the same rows.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from serving.embedded_model import ensure_model
from serving.stack import ModeStack
from serving.topology import load_topology
from store.writer import Store
from tests.integration.test_session_stub import _locust_cmd, _locust_env, rows
from tests.integration.vllm_stack import free_port
from turnscope.commands import app

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "data" / "models" / "turnscope-tiny"


@pytest.fixture
def store(tmp_path) -> Store:
    """A store holding one complete run (2 turns), written before the bad input."""
    s = Store(tmp_path / "store")
    s.init()
    t = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
    with s.writer("earlier", "w") as w:
        w.append("runs_log", {"run_id": "earlier", "status": "running", "started_at": t, "updated_at": t})
        for i in range(2):
            w.append("turns", {"run_id": "earlier", "session_id": "s", "turn_index": i, "status": "ok",
                               "sent_at": t, "ttft_s": 0.1})
        w.append("runs_log", {"run_id": "earlier", "status": "complete", "started_at": t, "finished_at": t,
                              "updated_at": t + dt.timedelta(seconds=1)})
    return s


def unchanged(store: Store) -> None:
    """The store holds the earlier run, complete, with its 2 turns, and no other run or row."""
    assert rows(store, "SELECT run_id, status FROM runs") == [{"run_id": "earlier", "status": "complete"}]
    assert rows(store, "SELECT count(*) AS n FROM turns") == [{"n": 2}]
    assert rows(store, "SELECT count(*) AS n FROM runs_log") == [{"n": 2}]


def cli(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, list(args), env={"COLUMNS": "4000"})
    return r.exit_code, " ".join(r.output.split())


def eval_args(store: Store, *extra: str) -> list[str]:
    return ["eval", "--store", str(store.root), "--modes", "pd-bidir", "--histories", "text", *extra]


def workload(tmp_path: Path, text: str, name: str = "w.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


GOOD_ARCHETYPE = """name: w
seed: 1
mix:
  - archetype:
      name: a
      turns: {kind: constant, value: 2}
      first_prompt_tokens: {kind: constant, value: 50}
      new_tokens: {kind: constant, value: 10}
      output_tokens: {kind: constant, value: 8}
      gaps: {tool: {p: 1, gap: {kind: constant, value: 1}}}
"""


# ------------------------------------------------------------------------------ workload files


@pytest.mark.parametrize("text, expected", [
    ("name: w\nmix:\n  - {weight: 1, include: coding-agent.yaml\n", ["w.yaml", "line 4", "not valid YAML"]),
    ("name: w\nseed: [1\nmix: []\n", ["w.yaml", "line 3", "not valid YAML"]),
    ("name: w\nmix:\n  - weight: -1\n    include: coding-agent.yaml\n", ["w.yaml", "mix.0.weight", "greater than 0"]),
    ("name: w\nsessions: many\nmix:\n  - include: coding-agent.yaml\n", ["w.yaml", "sessions", "integer"]),
    ("name: w\n", ["w.yaml", "needs a 'mix' of archetypes or 'traces'"]),
])
def test_malformed_workload_yaml_is_refused_before_anything_starts(store, tmp_path, text, expected):
    code, out = cli(*eval_args(store, "--workload", str(workload(tmp_path, text))))
    assert code == 2, out
    for piece in expected:
        assert piece in out, out
    unchanged(store)


def test_truncated_workload_yaml_is_refused(store, tmp_path):
    full = (REPO / "data" / "workloads" / "coding-agent.yaml").read_text()
    cut = full[: full.index("output_tokens")]  # the file ends before its archetype is whole
    code, out = cli(*eval_args(store, "--workload", str(workload(tmp_path, cut, "coding-agent.yaml"))))
    assert code == 2 and "coding-agent.yaml" in out and "output_tokens" in out and "Field required" in out, out
    unchanged(store)


# ------------------------------------------------------------------------------- trace files


def _mooncake(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


GOOD_MC = '{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}'


@pytest.mark.parametrize("bad, expected", [
    ('{"timestamp": 5, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]', ":2: not valid JSON"),
    ('{"timestamp": 5, "output_length": 10, "hash_ids": [1, 2]}', ":2: input_length: expected an integer >= 0, got None"),
    ('{"timestamp": 5, "input_length": 600, "output_length": -3, "hash_ids": [1, 2]}',
     ":2: output_length: expected an integer >= 0, got -3"),
    ('{"timestamp": -1, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}',
     ":2: timestamp: expected an integer >= 0, got -1"),
])
def test_bad_mooncake_trace_lines_are_refused_with_file_and_line(store, tmp_path, bad, expected):
    trace = _mooncake(tmp_path, [GOOD_MC, bad])
    w = workload(tmp_path, f"name: w\ntraces:\n  - {{format: mooncake, path: {trace}}}\n")
    code, out = cli(*eval_args(store, "--workload", str(w)))
    assert code == 2 and f"{trace}{expected}" in out, out
    unchanged(store)


def test_unsorted_trace_timestamps_are_refused(store, tmp_path):
    trace = _mooncake(tmp_path, [GOOD_MC.replace('"timestamp": 0', '"timestamp": 900'), GOOD_MC])
    w = workload(tmp_path, f"name: w\ntraces:\n  - {{format: mooncake, path: {trace}}}\n")
    code, out = cli(*eval_args(store, "--workload", str(w)))
    assert code == 2 and f"{trace}:2: timestamp: 0 is before the previous line's 900" in out, out
    csv = tmp_path / "azure.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:50.0,10,5\n"
                   "2023-11-16 18:15:46.0,10,5\n")
    w = workload(tmp_path, f"name: w\ntraces:\n  - {{format: azure, path: {csv}}}\n")
    code, out = cli(*eval_args(store, "--workload", str(w)))
    assert code == 2 and f"{csv}:3: TIMESTAMP:" in out and "is before the previous row's" in out, out
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:50.0,-10,5\n")
    code, out = cli(*eval_args(store, "--workload", str(w)))
    assert code == 2 and f"{csv}:2: ContextTokens: expected an integer >= 0" in out, out
    unchanged(store)


def test_missing_trace_file_is_refused(store, tmp_path):
    w = workload(tmp_path, "name: w\ntraces:\n  - {format: mooncake, path: no-such.jsonl}\n")
    code, out = cli(*eval_args(store, "--workload", str(w)))
    assert code == 2 and "traces.0.path: no-such.jsonl: no such file" in out, out
    unchanged(store)


# ----------------------------------------------------------------------------- topology files


def _topology(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "topo.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("text, expected", [
    ("name: t\nmodel: m\nprefill:\n  - {port: 8100, side_channel_port: 5600\n", ["topo.yaml", "line 5", "not valid YAML"]),
    ("name: t\nmodel: m\nprefill:\n  - {port: 8100, side_channel_port: 5600}\ndecode:\n  - {port: 0, side_channel_port: 5601}\n",
     ["topo.yaml", "decode.0.port", "greater than 0"]),
    ("name: t\nmodel: m\nprefill:\n  - {port: 8100}\ndecode:\n  - {port: 8101, side_channel_port: 5601}\n",
     ["topo.yaml", "side_channel_port is required"]),
    ("name: t\nmodel: m\naggregated:\n  - {port: 8100, gpu: 1}\n", ["topo.yaml", "aggregated.0.gpu", "Extra inputs"]),
])
def test_malformed_topology_yaml_is_refused(store, tmp_path, text, expected):
    code, out = cli("serve", "--topology", str(_topology(tmp_path, text)), "--dry-run")
    assert code == 2, out
    for piece in expected:
        assert piece in out, out
    code, out = cli(*eval_args(store, "--topology", str(_topology(tmp_path, text))))
    assert code == 2 and expected[1] in out, out
    unchanged(store)


def test_truncated_topology_yaml_is_refused(store, tmp_path):
    full = (REPO / "data" / "topologies" / "embedded-cpu.yaml").read_text()
    cut = full[: full.index("decode:")]  # P listed, D lost
    code, out = cli("serve", "--topology", str(_topology(tmp_path, cut)), "--dry-run")
    assert code == 2 and "topo.yaml: topology: " in out and "needs prefill and decode workers" in out, out


# --------------------------------------------------------------------- modes, models, ports, store


def test_unknown_mode_is_refused(store):
    code, out = cli(*["eval", "--store", str(store.root), "--modes", "pd,pd-bidirectional"])
    assert code == 2 and "unknown mode 'pd-bidirectional'; expected one of aggregated, pd, pd-bidir" in out, out
    code, out = cli("serve", "--mode", "turbo", "--dry-run")
    assert code == 2 and "unknown mode 'turbo'" in out, out
    unchanged(store)


def test_unknown_routing_policy_is_refused(store, monkeypatch):
    code, out = cli(*eval_args(store, "--prefill-routing", "session,random"))
    assert code == 2 and "--prefill-routing takes policies of round-robin, session, prefix-aware, comma-separated; " \
        "got 'session,random'" in out, out
    code, out = cli("serve", "--dry-run", "--prefill-routing", "random")
    assert code == 2 and "Invalid value for '--prefill-routing': Value error, 'random' is not one of " \
        "'round-robin', 'session', 'prefix-aware'" in out, out
    monkeypatch.setenv("TURNSCOPE_DECODE_ROUTING", "sticky")
    code, out = cli("serve", "--dry-run")
    assert code == 2 and "decode_routing: Input should be" in out and "from env TURNSCOPE_DECODE_ROUTING" in out, out
    unchanged(store)


def test_routing_options_win_over_the_topology_file(monkeypatch):
    """The 2P1D file says session for both; the option replaces one, the env var does not touch a file's."""
    topo = "data/topologies/embedded-cpu-2p1d.yaml"
    code, out = cli("serve", "--topology", topo, "--mode", "pd", "--dry-run")
    assert code == 0 and "prefill routing session, decode routing session" in out, out
    monkeypatch.setenv("TURNSCOPE_PREFILL_ROUTING", "prefix-aware")
    code, out = cli("serve", "--topology", topo, "--mode", "pd", "--dry-run", "--prefill-routing", "round-robin")
    assert code == 0 and "prefill routing round-robin, decode routing session" in out, out
    code, out = cli("serve", "--mode", "pd", "--dry-run")  # the embedded layout takes the settings'
    assert code == 0 and "prefill routing prefix-aware, decode routing session" in out, out


def test_model_path_that_does_not_exist_is_refused(store, tmp_path):
    topo = _topology(tmp_path, (REPO / "data" / "topologies" / "embedded-cpu.yaml").read_text()
                     .replace("../models/turnscope-tiny", str(tmp_path / "no-model")))
    code, out = cli(*eval_args(store, "--topology", str(topo)))
    assert code == 2 and f"model path {tmp_path / 'no-model'} does not exist" in out, out
    unchanged(store)


def _embedded_topology_file(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    """The shipped embedded topology on free ports, its model built if missing (a fresh clone has
    none until a test builds it, and a module using this may run first)."""
    ensure_model()
    ports = {k: free_port() for k in ("p", "d", "a", "ps", "ds", "proxy")}
    text = (REPO / "data" / "topologies" / "embedded-cpu.yaml").read_text().replace("../models", str(REPO / "data" / "models"))
    for old, new in (("port: 8100, side_channel_port: 5600", f"port: {ports['p']}, side_channel_port: {ports['ps']}"),
                     ("port: 8101, side_channel_port: 5601", f"port: {ports['d']}, side_channel_port: {ports['ds']}"),
                     ("port: 8102", f"port: {ports['a']}"), ("port: 8200", f"port: {ports['proxy']}")):
        assert old in text
        text = text.replace(old, new)
    return _topology(tmp_path, text), ports


@pytest.mark.parametrize("busy", ["proxy", "ds"])
def test_port_in_use_is_named_and_nothing_starts(store, tmp_path, busy):
    topo_path, ports = _embedded_topology_file(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[busy]))
        s.listen()
        stack = ModeStack("pd-bidir", load_topology(topo_path), tmp_path / "logs")
        with pytest.raises(RuntimeError, match=rf"port {ports[busy]} on 127\.0\.0\.1 .* already in use"):
            stack.__enter__()
        assert all(w.proc is None for w in stack.workers) and stack.proxy is None  # nothing was started
        code, out = cli("serve", "--topology", str(topo_path), "--mode", "pd-bidir")
        assert code == 2 and f"port {ports[busy]} on 127.0.0.1" in out and "nothing was started" in out, out
        code, out = cli(*eval_args(store, "--topology", str(topo_path)))
        assert code == 2 and f"port {ports[busy]} on 127.0.0.1" in out, out
    unchanged(store)


def test_a_second_stack_on_ports_another_is_starting_on_fails_before_starting_anything(store, tmp_path):
    """A stack that has claimed its ports but whose workers do not listen yet (still loading their
    model) makes a second stack on the same ports fail at once, naming the first port and the
    claimant's pid (this process); once the first releases, the ports can be claimed again."""
    topo_path, ports = _embedded_topology_file(tmp_path)
    first = ModeStack("pd-bidir", load_topology(topo_path), tmp_path / "logs-a")
    first.check_ports()  # claimed; nothing listens on any of them
    try:
        second = ModeStack("pd-bidir", load_topology(topo_path), tmp_path / "logs-b")
        with pytest.raises(RuntimeError, match=rf"port {ports['p']} on 127\.0\.0\.1 \(worker prefill-0\) is "
                                               rf"already claimed .*\(pid {os.getpid()}\); nothing was started"):
            second.__enter__()
        assert all(w.proc is None for w in second.workers) and second.proxy is None
        code, out = cli("serve", "--topology", str(topo_path), "--mode", "pd-bidir")
        assert code == 2 and f"port {ports['p']} on 127.0.0.1" in out and "nothing was started" in out, out
    finally:
        first.port_claims.release()
    again = ModeStack("pd-bidir", load_topology(topo_path), tmp_path / "logs-c")
    again.check_ports()
    again.port_claims.release()
    unchanged(store)


def test_store_directory_that_is_not_writable_is_named(store, tmp_path):
    for bad in (tmp_path / "a-file", tmp_path / "a-file" / "store"):
        (tmp_path / "a-file").write_text("not a directory")
        code, out = cli("eval", "--store", str(bad), "--modes", "pd-bidir", "--histories", "text")
        assert code == 2 and f"store directory {bad}: expected a directory this process can write" in out, out
    unchanged(store)


# ---------------------------------------------------------------------------- through Locust


@pytest.mark.parametrize("case", ["workload", "store"])
def test_locust_refuses_bad_input_with_a_named_error_and_records_no_run(store, tmp_path, case):
    args = ["--headless", "-u", "1", "-r", "1", "--run-time", "30s", "--host", "http://127.0.0.1:9",
            "--turnscope-run-id", "bad", "--turnscope-store", str(store.root)]
    if case == "workload":
        w = workload(tmp_path, "name: w\nmix:\n  - {weight: 1, include: coding-agent.yaml\n")
        args += ["--turnscope-workload", str(w)]
        expected = f"{w}: line 4, column 1: not valid YAML"
    else:
        (tmp_path / "a-file").write_text("x")
        args[-1] = str(tmp_path / "a-file")
        expected = f"store directory {tmp_path / 'a-file'}: expected a directory this process can write"
    proc = subprocess.run(_locust_cmd(*args), check=False, cwd=REPO, env=_locust_env(), capture_output=True, text=True, timeout=90)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "cannot start the run" in out and expected in " ".join(out.split()), out[-3000:]
    unchanged(store)
    assert not (store.root / "runs" / "bad").exists()


def test_json_of_a_bad_trace_names_line_and_column(tmp_path):
    """tau-bench traces are JSON documents: the position of the error is its line and column."""
    from loadgen.traces.taubench import TraceFormatError, load_taubench

    p = tmp_path / "t.json"
    p.write_text(json.dumps([{"task_id": 1, "trial": 0, "traj": []}], indent=1)[:-3])
    with pytest.raises(TraceFormatError, match=rf"{p}: not valid JSON: line \d+ column \d+"):
        load_taubench(p)
    p.write_text(json.dumps([{"task_id": 1, "trial": 0, "traj": [{"role": "bot", "content": "x"}]}]))
    with pytest.raises(TraceFormatError, match=r"\[0\]\.traj\[0\]\.role: expected one of .* got 'bot'"):
        load_taubench(p)
