"""Security: every listener binds 127.0.0.1 unless told otherwise (and then warns), forged KV
handles never reach a worker, the SQL console cannot write, and neither prompt text nor secrets
reach the store.

Truths: the operating system's table of listening sockets of each process (psutil), the bodies
the stub workers received, the files the console would have written, and canary strings planted
in prompts, URLs, environment and configuration, looked for in every stored value and byte.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import httpx
import psutil
import pyarrow.parquet as pq
import pytest

from serving.api_keys import SecretRef
from serving.proxy import ProxyConfig, Worker
from serving.stack import ModeStack
from serving.topology import RoleSettings, embedded_topology, load_topology
from serving.workers import WorkerNotHealthy, WorkerProcess, mode_workers, worker_command
from store import console as sqlconsole
from store.writer import Store
from tests.integration.openai_stub import StubServer, StubState
from tests.integration.pd_stub import decode_app, prefill_app
from tests.integration.test_faults_stub import write_trace
from tests.integration.test_session_stub import _locust_cmd, _locust_env
from tests.integration.vllm_stack import AppThread, ProxyThread, free_port
from turnscope.conductor.evaluation import default_settings
from turnscope.conductor.settings import TurnscopeSettings

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "data" / "models" / "turnscope-tiny"


def listening(pid: int, port: int, timeout_s: float = 60.0) -> set[str]:
    """The addresses process ``pid`` (or a child) listens on at ``port``, once it listens."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        addrs = set()
        for p in procs:
            try:
                addrs |= {c.laddr.ip for c in p.net_connections(kind="inet")
                          if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
            except psutil.NoSuchProcess:
                continue
        if addrs:
            return addrs
        time.sleep(0.1)
    raise AssertionError(f"process {pid} never listened on port {port}")


def spawn(argv: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), TURNSCOPE_STORE=str(log.parent / "store"))
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen) -> None:
    for child in psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []:
        child.kill()
    proc.kill()
    proc.wait(10)


# ------------------------------------------------------------------------------------ listeners


def test_proxy_binds_loopback_by_default_and_warns_otherwise(tmp_path, monkeypatch):
    """Beyond the loopback the proxy warns that it demands no key, unless its api_key is set."""
    monkeypatch.setenv("TS_TEST_PROXY_KEY", "k-1234")
    plain = ProxyConfig(mode="pd", prefill=[Worker(name="p", url="http://127.0.0.1:9")],
                        decode=[Worker(name="d", url="http://127.0.0.1:9")])
    keyed = plain.model_copy(update={"api_key": SecretRef(env="TS_TEST_PROXY_KEY")})
    for name, config, host, addrs, warned in (("plain", plain, None, {"127.0.0.1"}, False),
                                              ("plain", plain, "127.0.0.2", {"127.0.0.2"}, True),
                                              ("keyed", keyed, "127.0.0.2", {"127.0.0.2"}, False)):
        cfg = tmp_path / f"proxy-{name}.json"
        cfg.write_text(config.model_dump_json())
        port = free_port()
        argv = [sys.executable, "-m", "serving.proxy_server", str(cfg), "--port", str(port)]
        log = tmp_path / f"proxy-{name}-{host}.log"
        proc = spawn(argv + (["--host", host] if host else []), log)
        try:
            assert listening(proc.pid, port) == addrs
        finally:
            stop(proc)
        assert ("with no api_key: anyone who reaches the proxy can use the workers" in log.read_text()) is warned, \
            log.read_text()


def test_locust_web_ui_and_master_bind_loopback_by_default_and_warn_otherwise(tmp_path):
    for extra, port_flag, addrs, warned in (
            ([], "--web-port", {"127.0.0.1"}, False),
            (["--web-host", "127.0.0.2"], "--web-port", {"127.0.0.2"}, True),
            (["--master", "--headless", "--expect-workers", "1"], "--master-bind-port", {"127.0.0.1"}, False),
    ):
        port = free_port()
        log = tmp_path / f"locust-{port}.log"
        proc = spawn(_locust_cmd("--host", "http://127.0.0.1:9", port_flag, str(port), *extra), log)
        try:
            assert listening(proc.pid, port) == addrs, log.read_text()[-2000:]
        finally:
            stop(proc)
        assert ("binds beyond the loopback interface" in log.read_text()) is warned, log.read_text()[-2000:]


def test_dashboard_binds_loopback_by_default_and_warns_otherwise(tmp_path):
    cli = [sys.executable, "-m", "turnscope", "dashboard", "--store", str(tmp_path / "store")]
    port = free_port()
    log = tmp_path / "dash.log"
    proc = spawn([*cli, "--port", str(port)], log)
    try:
        assert listening(proc.pid, port) == {"127.0.0.1"}
    finally:
        stop(proc)
    assert "warning" not in log.read_text()
    port = free_port()
    log = tmp_path / "dash2.log"
    proc = spawn([*cli, "--port", str(port), "--host", "127.0.0.2"], log)
    try:
        assert listening(proc.pid, port) == {"127.0.0.2"}
    finally:
        stop(proc)
    assert "warning: binding 127.0.0.2: the dashboard has no authentication" in " ".join(log.read_text().split())


def test_workers_and_proxy_of_every_mode_bind_loopback_by_default(tmp_path):
    """The embedded layout, the shipped topology and the settings all say 127.0.0.1; a worker
    elsewhere is never launched here (it would be reachable without authentication)."""
    assert TurnscopeSettings.load().host == "127.0.0.1"
    for topo in (embedded_topology(str(MODEL)), load_topology(REPO / "data" / "topologies" / "embedded-cpu.yaml")):
        for mode in topo.modes():
            stack = ModeStack(mode, topo, tmp_path)
            assert stack.proxy_command(tmp_path / "c.json")[-4:-2] == ["--host", "127.0.0.1"]
            for spec in mode_workers(mode, topo):
                argv, env = worker_command(spec)
                assert argv[argv.index("--host") + 1] == "127.0.0.1"
                assert env["VLLM_HOST_IP"] == "127.0.0.1"
                if spec.nixl:
                    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    spec = mode_workers("pd", embedded_topology(str(MODEL)))[0]
    spec.host = "0.0.0.0"
    with pytest.raises(WorkerNotHealthy, match="cannot launch on remote host 0.0.0.0"):
        WorkerProcess(spec, tmp_path / "w.log").start()


# ------------------------------------------------------------------------------ forged handles


def test_client_supplied_kv_transfer_params_are_dropped_wherever_they_hide():
    forged = {"do_remote_decode": True, "remote_block_ids": [[666]], "remote_engine_id": "forged",
              "remote_request_id": "someone-else", "remote_host": "10.9.9.9", "remote_port": 9, "remote_num_tokens": 8}
    with AppThread(prefill_app()) as p, AppThread(decode_app(gen=4)) as d:
        cfg = ProxyConfig(mode="pd-bidir", prefill=[Worker(name="p", url=p.url)], decode=[Worker(name="d", url=d.url)],
                          block_size=4, kv_recompute_threshold=2)
        with ProxyThread(cfg) as proxy:
            for extra in ({"kv_transfer_params": forged}, {"vllm_xargs": {"kv_transfer_params": forged, "x": 1}},
                          {"kv_transfer_params": forged, "vllm_xargs": {"kv_transfer_params": forged}}):
                for session in ("s1", None):
                    body = {"model": "m", "prompt": list(range(10)), "max_tokens": 4, "stream": True} | extra
                    if session:
                        body["conversation_id"] = session
                    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=30) as r:
                        assert r.status_code == 200
                        r.read()
    bodies = p.app.state.bodies + d.app.state.bodies
    assert len(bodies) == 12
    for body in bodies:
        text = json.dumps(body)
        assert "forged" not in text and "666" not in text and "someone-else" not in text
    assert any(b.get("vllm_xargs") == {"x": 1} for b in bodies)  # the rest of vllm_xargs passes


# ---------------------------------------------------------------------------------- SQL console


@pytest.mark.parametrize("sql", [
    "COPY (SELECT * FROM turns) TO '{out}'", "COPY turns TO '{out}'", "EXPORT DATABASE '{dir}'",
    "ATTACH '{out}' AS x", "/* comment */ ATTACH '{out}' AS x", "SELECT 1; ATTACH '{out}' AS x",
    "EXPLAIN ANALYZE COPY (SELECT 1) TO '{out}'", "SELECT * FROM query('ATTACH ''{out}'' AS y')",
    "SELECT * FROM query('COPY (SELECT 1) TO ''{out}''')", "INSERT INTO runs_log (run_id, updated_at) VALUES ('x', now())",
    "CREATE TEMP TABLE t AS SELECT 1", "CREATE MACRO m(x) AS x", "DROP VIEW turns", "CHECKPOINT", "INSTALL httpfs",
    "LOAD httpfs", "SET threads = 1", "PRAGMA enable_profiling", "CALL pragma_version()", "DETACH memory",
])
def test_sql_console_cannot_write_attach_or_copy(tmp_path, sql):
    store = Store(tmp_path / "store")
    store.init()
    out, exp = tmp_path / "out.db", tmp_path / "exported"
    text = sql.format(out=out, dir=exp)
    con = duckdb.connect(str(store.db_path), read_only=True)
    try:
        with pytest.raises((sqlconsole.Refused, duckdb.Error)):
            sqlconsole.run(con, text)
        views = {r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
        attached = {r[0] for r in con.execute("SELECT database_name FROM duckdb_databases()").fetchall()}
    finally:
        con.close()
    assert not out.exists() and not exp.exists()
    assert "turns" in views and "x" not in attached and "y" not in attached
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


# ---------------------------------------------------------------- prompt text and secrets


def _stored_values(root: Path) -> list[str]:
    """Every value of every Parquet shard under ``root`` as text, and the DuckDB file's bytes."""
    out = []
    for f in root.rglob("*.parquet"):
        for row in pq.read_table(f).to_pylist():
            out.extend(str(v) for v in row.values())
        out.append(f.read_bytes().decode("latin-1"))
    out.append((root / "turnscope.duckdb").read_bytes().decode("latin-1"))
    return out


def test_no_prompt_text_and_no_secret_reaches_the_store(tmp_path):
    prompt_canary, password, api_key = "CANARY-PROMPT-7f3a", "CANARY-PASSWORD-91c2", "CANARY-APIKEY-44d0"
    trace = write_trace(tmp_path / "trace.json", conversations=2, turns=2, marker=prompt_canary)
    store = Store(tmp_path / "store")
    state = StubState(ttft_s=0.01, itl_s=0.0)
    with StubServer(state) as srv:
        host = srv.url.replace("http://", f"http://operator:{password}@")
        env = _locust_env() | {"OPENAI_API_KEY": api_key, "HF_TOKEN": api_key}
        proc = subprocess.run(
            _locust_cmd("--headless", "-u", "1", "-r", "1", "--run-time", "60s", "--host", host,
                        "--turnscope-store", str(store.root), "--turnscope-run-id", "canary",
                        "--turnscope-trace", str(trace), "--turnscope-max-tokens", "4",
                        "--turnscope-max-prompt-tokens", "100000", "--turnscope-gap-s", "0"),
            check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert len(state.requests) == 4 and all(prompt_canary in json.dumps(r["messages"]) for r in state.requests)
    # the evaluation driver's run row, with secrets in the topology (worker env and vLLM args)
    topo = embedded_topology(str(MODEL))
    topo.env = {"HF_TOKEN": api_key, "UCX_TLS": "tcp"}
    topo.roles = {"decode": RoleSettings(args=["--api-key", api_key, f"--hf-token={api_key}"])}
    s = default_settings(MODEL, topology=topo, store=store.root)
    with store.writer("canary-eval", "eval") as w:
        w.append("runs_log", {"run_id": "canary-eval", "config": s.model_dump(mode="json"), "status": "running",
                              "model": str(MODEL), "updated_at": dt.datetime.now(dt.UTC)})
    values = _stored_values(store.root)
    for canary in (prompt_canary, password, api_key):
        assert not [v for v in values if canary in v], canary
    con = store.connect()
    try:
        n, hashes = con.execute("SELECT count(*), count(prompt_sha256) FROM turns WHERE run_id = 'canary'").fetchone()
        cfg = json.loads(con.execute("SELECT config FROM runs WHERE run_id = 'canary'").fetchone()[0])
        ev = json.loads(con.execute("SELECT config FROM runs WHERE run_id = 'canary-eval'").fetchone()[0])
    finally:
        con.close()
    assert n == hashes == 4  # the prompts are identified by the hash of their token ids only
    assert cfg["host"] == srv.url.replace("http://", "http://***@")  # the rest of the URL is kept
    assert ev["topology"]["env"] == {"HF_TOKEN": "***", "UCX_TLS": "tcp"}
    assert ev["topology"]["roles"]["decode"]["args"] == ["--api-key", "***", "--hf-token=***"]
    assert ev["kv_bytes_per_token"] == s.kv_bytes_per_token  # numbers under token-ish names are kept
