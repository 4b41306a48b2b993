"""Start, check and stop vLLM workers for one serving mode (DESIGN §2).

A mode is a set of :class:`WorkerSpec` (``aggregated``: one worker; the ``pd*`` modes: one P and
one D with the NixlConnector). :func:`worker_command` renders the exact command line and
environment; :class:`WorkerProcess` runs it in its own process group, waits on ``/health`` and
stops it. On the CPU platform, :func:`pin_process_tree` undoes the NIXL worker set-up pinning
every worker's main thread to the last core (``os.sched_setaffinity`` in vLLM's
``nixl/base_worker.py``), which starves P's compute thread behind D's busy threads (10-100 s
stalls; research/bidir-hang.md): after both report healthy, all threads of P's processes go to
P's cores and D's to D's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

MODES = ("aggregated", "pd", "pd-bidir", "pd-nocache", "pd-bidir-nocache")


@dataclass
class ConnectorSettings:
    """NixlConnector ``kv_connector_extra_config`` keys (vLLM docs/features/nixl_connector_usage.md).

    Defaults are vLLM's: ``kv_recompute_threshold`` 64 tokens, ``decoder_kv_blocks_ttl`` 480 s,
    ``kv_lease_duration`` 30 s, ``backends`` ["UCX"]. ``kv_load_failure_policy`` "recompute" makes
    a failed or declined pull fall back to computing the prompt instead of failing the request.
    """

    kv_recompute_threshold: int = 64
    decoder_kv_blocks_ttl: int = 480
    kv_lease_duration: int = 30
    backends: list[str] = field(default_factory=lambda: ["UCX"])
    kv_load_failure_policy: str = "recompute"
    kv_buffer_device: str = "cpu"


@dataclass
class WorkerSpec:
    """One vLLM worker: its role (prefill|decode|aggregated), ports, cores and flags."""

    name: str
    role: str
    port: int
    model: str
    served_model_name: str = "turnscope-tiny"
    side_channel_port: int | None = None
    cores: list[int] = field(default_factory=lambda: [0])
    nixl: bool = False
    bidirectional: bool = False
    prefix_caching: bool = True
    connector: ConnectorSettings = field(default_factory=ConnectorSettings)
    kv_cache_bytes: int = 512 * 2**20
    max_model_len: int = 8192
    dtype: str = "float32"
    host: str = "127.0.0.1"
    extra_args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def mode_workers(mode: str, model: str, base_port: int = 8100, side_channel_base: int = 5600,
                 connector: ConnectorSettings | None = None, **overrides) -> list[WorkerSpec]:
    """The workers a mode runs. P gets core 0, D core 1; ``aggregated`` one worker on core 0.

    Raises ValueError for an unknown mode (the valid ones are :data:`MODES`).
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    connector = connector or ConnectorSettings()
    if mode == "aggregated":
        return [WorkerSpec(name="aggregated-0", role="aggregated", port=base_port, model=model,
                           cores=[0], connector=connector, **overrides)]
    bidir = "bidir" in mode
    p_cache = "nocache" not in mode
    return [
        WorkerSpec(name="prefill-0", role="prefill", port=base_port, model=model, cores=[0], nixl=True,
                   side_channel_port=side_channel_base, bidirectional=bidir, prefix_caching=p_cache,
                   connector=connector, **overrides),
        WorkerSpec(name="decode-0", role="decode", port=base_port + 1, model=model, cores=[1], nixl=True,
                   side_channel_port=side_channel_base + 1, bidirectional=bidir, prefix_caching=True,
                   connector=connector, **overrides),
    ]


def kv_transfer_config(spec: WorkerSpec) -> dict:
    """The ``--kv-transfer-config`` JSON for a NIXL worker."""
    c = spec.connector
    extra = {"backends": c.backends, "kv_lease_duration": c.kv_lease_duration}
    if spec.bidirectional:
        extra |= {"bidirectional_kv_xfer": True, "kv_recompute_threshold": c.kv_recompute_threshold,
                  "decoder_kv_blocks_ttl": c.decoder_kv_blocks_ttl}
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": c.kv_buffer_device,
            "kv_load_failure_policy": c.kv_load_failure_policy, "kv_connector_extra_config": extra}


def worker_command(spec: WorkerSpec) -> tuple[list[str], dict[str, str]]:
    """``(argv, env additions)`` that start the worker; the same flags as ``vllm serve``."""
    argv = [sys.executable, "-m", "serving.vllm_worker", "--model", spec.model,
            "--served-model-name", spec.served_model_name, "--host", spec.host, "--port", str(spec.port),
            "--dtype", spec.dtype, "--max-model-len", str(spec.max_model_len),
            "--kv-cache-memory-bytes", str(spec.kv_cache_bytes),
            "--enable-prefix-caching" if spec.prefix_caching else "--no-enable-prefix-caching",
            "--disable-uvicorn-access-log"]
    if spec.nixl:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(spec))]
    argv += spec.extra_args
    env = {"HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": spec.host, "VLLM_CPU_OMP_THREADS_BIND":
           ",".join(map(str, spec.cores)), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    if spec.nixl:
        env |= {"VLLM_NIXL_SIDE_CHANNEL_HOST": spec.host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(spec.side_channel_port)}
    return argv, env


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


class WorkerNotHealthy(RuntimeError):
    """A worker exited or did not answer /health in time; the message names it and its log."""


class WorkerProcess:
    """A running worker: ``start()``, ``wait_healthy()``, ``stop()``. Logs go to ``log_path``."""

    def __init__(self, spec: WorkerSpec, log_path: Path):
        self.spec = spec
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        argv, env = worker_command(self.spec)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        repo_root = str(Path(__file__).resolve().parents[1])
        full_env = os.environ | env | {"PYTHONPATH": repo_root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                         start_new_session=True, cwd=repo_root)

    def wait_healthy(self, timeout_s: float = 240.0) -> float:
        """Block until ``/health`` answers 200; return the seconds waited. Raises WorkerNotHealthy."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc is not None and self.proc.poll() is not None:
                raise WorkerNotHealthy(f"worker {self.spec.name} exited with {self.proc.returncode} while "
                                       f"starting; last log lines:\n{self.tail()}")
            try:
                if httpx.get(self.spec.url + "/health", timeout=2.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise WorkerNotHealthy(f"worker {self.spec.name} not healthy at {self.spec.url}/health after "
                               f"{timeout_s:.0f} s; log: {self.log_path}\n{self.tail()}")

    def pin(self) -> int:
        """Re-pin all threads of this worker's process tree to its cores (see module docstring)."""
        return pin_process_tree(self.proc.pid, self.spec.cores) if self.proc else 0

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
