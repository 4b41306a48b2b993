"""One serving mode running: its workers (launched or attached) and turnscope's proxy in front.

``ModeStack`` reads every API key the topology names (a key that cannot be read fails before
anything starts), claims every port it will bind (``serving.port_claims``: a second turnscope started
moments later fails at once instead of after loading a model), starts the workers of a mode (``serving.workers``), waits on ``/health``, re-pins
them on the CPU platform, checks that each worker takes its role's key (``serving.workers.check_credentials``),
reads the KV block size they report, writes the proxy's configuration (key references only, never
a key) and starts ``python -m serving.proxy_server``; in a bidirectional mode it then checks that
every decode worker returns its KV handle in streamed answers (``serving.handle_check``) and
refuses the mode otherwise. On exit it stops everything it started.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from core import resources
from core.contract import WORKER_ROLES, Role
from core.modes import serving_mode
from serving.api_keys import bearer, resolve_optional
from serving.handle_check import check_streamed_handles
from serving.kv_size import kv_bytes_per_token as kv_bytes_per_token_of
from serving.port_claims import PortClaims
from serving.prefix_index import DEFAULT_CAPACITY_BLOCKS
from serving.proxy import ProxyConfig, Worker
from serving.topology import Topology
from serving.workers import (
    WorkerProcess,
    check_credentials,
    mode_workers,
    port_in_use,
    wait_all_healthy,
    wait_http,
    worker_block_size,
)


class StackAccess:
    """How a client reaches a stack's proxy and workers: the keys and TLS verification its topology
    names (``serving.api_keys``, ``serving.upstream_tls``). Needs ``topology``, ``workers`` and
    ``proxy_url`` on the object (:class:`ModeStack`; the tests' stand-ins for it inherit this too)."""

    workers: Sequence = ()  # WorkerProcess of the stack; none for a stand-in that has no workers

    def client_key(self) -> str | None:
        """The key the proxy demands of its clients (the topology's ``proxy.api_key``), or None.
        Raises serving.api_keys.CredentialError when it cannot be read."""
        return resolve_optional(self.topology.proxy.api_key, "the proxy's api_key")

    def client_headers(self) -> dict[str, str]:
        """What a client of this stack's proxy sends with every request: its Bearer key, if any."""
        return bearer(self.client_key())

    def endpoint_headers(self) -> dict[str, dict[str, str]]:
        """Per base URL of :meth:`endpoints`, the headers a request to it carries (a worker's role's
        key; the proxy's client key)."""
        return {w.spec.url: w.spec.headers() for w in self.workers} | {self.proxy_url: self.client_headers()}

    def tls_verify(self):
        """httpx's ``verify=`` for the workers (the topology's ``tls``, ``serving.upstream_tls``)."""
        return self.topology.tls.httpx_verify()


class ModeStack(StackAccess):
    """The running workers + proxy of one mode (a context manager that always stops them)."""

    def __init__(self, mode: str, topology: Topology, log_dir: Path, kv_bytes_per_token: int | None = None,
                 progress=print):
        self.mode, self.topology, self.log_dir = mode, topology, Path(log_dir)
        self.kv_bytes_per_token = kv_bytes_per_token or kv_bytes_per_token_of(topology.model)
        self.progress = progress
        self.workers = [WorkerProcess(spec, self.log_dir / f"{mode}-{spec.name}.log")
                        for spec in mode_workers(mode, topology)]
        self.proxy: subprocess.Popen | None = None
        self.port_claims = PortClaims()
        self.proxy_url = f"http://{topology.proxy.host}:{topology.proxy.port}"
        self.block_size = 128  # vLLM's CPU block size; replaced by what the workers report

    def proxy_config(self) -> ProxyConfig:
        by_role = {r: [Worker(name=w.spec.name, url=w.spec.url, api_key=w.spec.api_key)
                       for w in self.workers if w.spec.role == r]
                   for r in WORKER_ROLES}
        p_spec = next((w.spec for w in self.workers if w.spec.role == Role.PREFILL), None)
        t = self.topology
        return ProxyConfig(mode=self.mode, prefill=by_role[Role.PREFILL], decode=by_role[Role.DECODE],
                           aggregated=by_role[Role.AGGREGATED],
                           decoder_kv_blocks_ttl_s=t.connector.decoder_kv_blocks_ttl,
                           kv_recompute_threshold=t.connector.kv_recompute_threshold,
                           handle_ttl_margin_s=t.proxy.handle_ttl_margin_s,
                           prefill_timeout_s=t.proxy.prefill_timeout_s, decode_timeout_s=t.proxy.decode_timeout_s,
                           prefill_prefix_caching=p_spec.prefix_caching if p_spec else True,
                           block_size=self.block_size, kv_bytes_per_token=self.kv_bytes_per_token,
                           prefill_routing=t.proxy.prefill_routing, decode_routing=t.proxy.decode_routing,
                           decode_probe_interval_s=t.proxy.decode_probe_interval_s,
                           prefill_cache_blocks=self.prefill_cache_blocks(p_spec),
                           api_key=t.proxy.api_key, tls=t.tls,
                           tokenizer_dir=t.model if (Path(t.model) / "tokenizer.json").is_file() else None)

    def prefill_cache_blocks(self, p_spec) -> int:
        """KV blocks of P's cache for the proxy's prefix index (``serving.prefix_index``): P's
        ``--kv-cache-memory-bytes`` (its role's own args first: :attr:`serving.workers.WorkerSpec.effective_kv_cache_bytes`)
        over the bytes of one block (block size x KV bytes per token) when both are known, else
        :data:`serving.prefix_index.DEFAULT_CAPACITY_BLOCKS`."""
        kv_bytes = p_spec.effective_kv_cache_bytes if p_spec else None
        if kv_bytes and self.kv_bytes_per_token:
            return max(kv_bytes // (self.block_size * self.kv_bytes_per_token), 1)
        return DEFAULT_CAPACITY_BLOCKS

    def topology_row(self) -> dict:
        return {"name": self.topology.name, "mode": self.mode, "workers": [
            {"name": w.spec.name, "role": w.spec.role, "url": w.spec.url, "cores": w.spec.cores,
             "prefix_caching": w.spec.prefix_caching, "bidirectional": w.spec.bidirectional,
             "nixl": w.spec.nixl} for w in self.workers], "proxy": self.proxy_url,
                "prefill_routing": self.topology.proxy.prefill_routing,
                "decode_routing": self.topology.proxy.decode_routing}

    def read_keys(self) -> None:
        """Read every API key the topology names (each worker's role's, the proxy's), so that one
        that cannot be read fails before anything starts. Raises serving.api_keys.CredentialError."""
        for w in self.workers:
            w.spec.key()
        self.client_key()

    def endpoints(self) -> list[tuple[str, str]]:
        return [(w.spec.url, w.spec.role) for w in self.workers] + [(self.proxy_url, Role.PROXY)]

    def proxy_command(self, config_path: Path) -> list[str]:
        """The proxy's command line for a ProxyConfig JSON at ``config_path``."""
        return [sys.executable, "-m", "serving.proxy_server", str(config_path),
                "--host", self.topology.proxy.host, "--port", str(self.topology.proxy.port)]

    def __enter__(self):
        try:
            return self._start()
        except BaseException:
            self.__exit__(None, None, None)  # never leave workers running after a failed start
            raise

    def check_ports(self) -> None:
        """Claim every port a launched worker (HTTP or NIXL side channel) or the proxy will bind
        (``serving.port_claims``), then check that nothing listens there yet, before anything is
        started. Raises RuntimeError (``PortTaken`` for a claim held by another turnscope) naming
        the first port that is taken."""
        needed = [(f"worker {w.spec.name}", w.spec.host, port) for w in self.workers if w.spec.launch
                  for port in filter(None, (w.spec.port, w.spec.side_channel_port))]
        needed.append(("the proxy", self.topology.proxy.host, self.topology.proxy.port))
        for who, host, port in needed:
            self.port_claims.claim(host, port, who)
        for who, host, port in needed:
            if port_in_use("127.0.0.1" if host in ("0.0.0.0", "::", "") else host, port):
                raise RuntimeError(f"port {port} on {host} ({who}) is already in use: another turnscope, vLLM "
                                   "or something else listens there (`ss -ltnp` shows who); nothing was started")

    def _start(self):
        self.launch()
        self.ready()
        return self.serve()

    def launch(self) -> None:
        """Claim the ports and start every worker, waiting on none (:meth:`ready` waits)."""
        self._t0 = time.monotonic()
        self.read_keys()
        self.check_ports()
        for w in self.workers:
            w.start()

    def ready(self, timeout_scale: float = 1.0) -> None:
        """Wait until the launched workers answer ``/health`` (``topology.startup_timeout_s`` x
        ``timeout_scale`` each: several stacks launched together share the cores), re-pin them and
        read their block size (:meth:`serve` then starts the proxy)."""
        t0 = getattr(self, "_t0", time.monotonic())
        wait_all_healthy(self.workers, self.topology.startup_timeout_s * timeout_scale)
        for w in self.workers:
            check_credentials(w.spec)
        first = self.workers[0].spec
        self.block_size = worker_block_size(first.url, headers=first.headers(),
                                            verify=first.tls.httpx_verify()) or self.block_size
        self.progress(f"  {self.mode}: {len(self.workers)} worker(s) healthy in {time.monotonic() - t0:.0f} s")

    def serve(self, timeout_scale: float = 1.0):
        """Start the proxy in front of the ready workers; it has the topology's ``startup_timeout_s`` x
        ``timeout_scale`` seconds to answer ``/health``. In a bidirectional mode, then check that
        every decode worker returns its handle in streamed answers (:meth:`check_handles`). Returns
        self. Raises serving.handle_check.StockDecodeError naming a decode worker that returns none."""
        self._start_proxy(self.topology.startup_timeout_s * timeout_scale)
        self.check_handles()
        return self

    def check_handles(self) -> None:
        """In a bidirectional mode, one short streamed turn per decode worker through the proxy
        (``serving.handle_check``): a D that returns no KV handle (a stock vLLM without PR 40186)
        refuses the mode, in words, rather than record every turn as ``miss_no_handle_returned``."""
        if not serving_mode(self.mode).bidirectional:
            return
        decodes = {w.spec.name: w.spec.url for w in self.workers if w.spec.role == Role.DECODE}
        seen = check_streamed_handles(self.proxy_url, self.topology.served_model_name or self.topology.model,
                                      decodes, self.client_headers())
        self.progress(f"  {self.mode}: streamed KV handles returned by {', '.join(sorted(seen))}")

    def _start_proxy(self, timeout_s: float | None = None) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cfg_path = self.log_dir / f"{self.mode}-proxy.json"
        cfg_path.write_text(self.proxy_config().model_dump_json(indent=2))
        with open(self.log_dir / f"{self.mode}-proxy.log", "ab") as log:
            env = os.environ | {"PYTHONPATH": resources.pythonpath(os.environ.get("PYTHONPATH"))}
            self.proxy = subprocess.Popen(self.proxy_command(cfg_path), stdout=log, stderr=subprocess.STDOUT,
                                          env=env, start_new_session=True)
        # The proxy's own start (Python imports) can take far longer than its usual 2-3 s on a loaded
        # machine (an empty log after 30 s at a load average of 23 once failed a demo whose workers
        # were healthy): it gets the workers' start-up limit; a proxy that exits still fails at once.
        wait_http(self.proxy_url + "/health", timeout_s or self.topology.startup_timeout_s, self.proxy)

    def _stop_proxy(self) -> None:
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.terminate()
            try:
                self.proxy.wait(10)
            except subprocess.TimeoutExpired:
                self.proxy.kill()

    def restart_proxy(self, prefill_routing: str) -> None:
        """Restart the proxy alone with another P routing policy (``serving.routing``), the workers
        kept: runs of several policies on the same workers (``turnscope eval --prefill-routing
        a,b``). ``topology.proxy`` says the policy in force (a copy: the caller's is untouched)."""
        self._stop_proxy()
        proxy = self.topology.proxy.model_copy(update={"prefill_routing": prefill_routing})
        self.topology = self.topology.model_copy(update={"proxy": proxy})
        self._start_proxy()

    def __exit__(self, *exc):
        self._stop_proxy()
        for w in self.workers:
            w.stop()
        self.port_claims.release()
        return False


@contextlib.contextmanager
def started_together(stacks: list[ModeStack]):
    """Every stack of ``stacks`` up at once (e.g. the modes of an interleaved comparison, each on its
    own ports: ``serving.topology.shifted``): all workers launched before any is waited on, so
    their start-ups overlap, and the proxies started once every worker answers; each worker's and
    proxy's start-up timeout is scaled by the number of stacks.
    Yields the stacks; on exit, or when any fails to start, stops every one of them."""
    with contextlib.ExitStack() as exits:
        for st in stacks:
            exits.callback(st.__exit__, None, None, None)
        for st in stacks:
            st.launch()
        # every stack's workers watched (and re-pinned) at once: one waited on alone would leave the
        # others' set-up threads on the core vLLM moved them to (serving.workers.wait_all_healthy)
        wait_all_healthy([w for st in stacks for w in st.workers],
                         max(st.topology.startup_timeout_s for st in stacks) * len(stacks))
        for st in stacks:
            st.ready(timeout_scale=len(stacks))
        # the proxies once every worker is up: they start faster than workers still loading would let them
        for st in stacks:
            st.serve(timeout_scale=len(stacks))
        yield stacks
