"""serving.kubernetes: every shipped topology's every mode renders objects that the Kubernetes
schemas accept, and the facts that matter hold (worked out by hand from the topology files).

Validators: core objects (Deployment, Service, ConfigMap, and a LeaderWorkerSet's pod templates as
v1 PodTemplates) with ``kubernetes-validate`` (the official OpenAPI schemas of Kubernetes 1.31,
strict: no unknown field); the PodMonitor with ``cloudcoil-models-prometheus-operator`` (pydantic
models generated from Prometheus Operator v0.80.1's CRDs; a field its schema lacks is dropped on
load, so the object must come back unchanged). The LeaderWorkerSet's own fields (size, restart
policy) are not validated: its CRD's schema is not shipped by any package here (docs/kubernetes.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from cloudcoil.models.prometheus_operator.v1 import PodMonitor

from serving import kubernetes as kube
from serving.api_keys import SecretRef
from serving.topology import RoleSettings, Topology, load_topology

REPO = Path(__file__).resolve().parents[2]
TOPOLOGIES = sorted((REPO / "data" / "topologies").glob("*.yaml"))
K8S_VERSION = "1.31"
IMAGE = "registry.example.com/turnscope:test"
OPTIONS = kube.KubeOptions(image=IMAGE)
CASES = [(path, mode) for path in TOPOLOGIES for mode in load_topology(path).modes()]


def validate(obj: dict) -> None:
    """Validate one rendered object with the validator of its kind (module doc)."""
    if obj["kind"] == "PodMonitor":
        assert PodMonitor.model_validate(obj).model_dump(by_alias=True, exclude_unset=True, mode="json") == obj
    elif obj["kind"] == "LeaderWorkerSet":
        group = obj["spec"]["leaderWorkerTemplate"]
        for which in ("leaderTemplate", "workerTemplate"):
            template = {"apiVersion": "v1", "kind": "PodTemplate",
                        "metadata": {"name": f"{obj['metadata']['name']}-{which.lower()}"}, "template": group[which]}
            kubernetes_validate.validate(template, K8S_VERSION, strict=True)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def by_kind_name(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def container(objects: list[dict], kind: str, name: str) -> dict:
    return by_kind_name(objects)[(kind, name)]["spec"]["template"]["spec"]["containers"][0]


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c["env"]}


def proxy_config(objects: list[dict]) -> dict:
    cm = next(o for o in objects if o["kind"] == "ConfigMap")
    return json.loads(cm["data"]["proxy.json"])


@pytest.mark.parametrize("path, mode", CASES, ids=[f"{p.stem}-{m}" for p, m in CASES])
def test_every_shipped_topology_and_mode_validates(path: Path, mode: str) -> None:
    objects = kube.render_objects(load_topology(path), mode, OPTIONS)
    for obj in objects:
        validate(obj)
    kinds = [o["kind"] for o in objects]
    workers = len([s for s in kinds if s == "Deployment"]) - 1  # one is the proxy's
    assert kinds.count("Service") == workers + 1 and kinds.count("PodMonitor") == 1


def test_pd_bidir_decode_on_embedded_cpu() -> None:
    """embedded-cpu.yaml: D listens on 8101 with side channel 5601; pd-bidir sets bidirectional_kv_xfer."""
    objects = kube.render_objects(load_topology(REPO / "data/topologies/embedded-cpu.yaml"), "pd-bidir", OPTIONS)
    d = container(objects, "Deployment", "embedded-cpu-pd-bidir-decode-0")
    args = d["args"]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "NixlConnector"
    assert kv["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True
    assert args[args.index("--host") + 1] == "0.0.0.0" and args[args.index("--port") + 1] == "8101"
    env = env_of(d)
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "5601"
    assert "GLOO_SOCKET_IFNAME" not in env and "VLLM_CPU_OMP_THREADS_BIND" not in env  # host-only settings
    assert d["command"] == ["python3", "-m", "serving.vllm_worker"] and d["image"] == IMAGE
    assert d["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    svc = by_kind_name(objects)[("Service", "embedded-cpu-pd-bidir-decode-0")]
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"http": 8101, "nixl": 5601}


def test_pd_keeps_one_way_transfer() -> None:
    objects = kube.render_objects(load_topology(REPO / "data/topologies/embedded-cpu.yaml"), "pd", OPTIONS)
    args = container(objects, "Deployment", "embedded-cpu-pd-decode-0")["args"]
    assert "bidirectional_kv_xfer" not in args[args.index("--kv-transfer-config") + 1]


def test_proxy_config_points_at_the_services() -> None:
    topo = load_topology(REPO / "data/topologies/embedded-cpu-2p1d.yaml")
    objects = kube.render_objects(topo, "pd-bidir", kube.KubeOptions(image=IMAGE, namespace="serving"))
    cfg = proxy_config(objects)
    dns = "pd-bidir-{}.serving.svc.cluster.local"
    assert [w["url"] for w in cfg["prefill"]] == [f"http://embedded-cpu-2p1d-{dns.format('prefill-0')}:8100",
                                                  f"http://embedded-cpu-2p1d-{dns.format('prefill-1')}:8103"]
    assert [w["url"] for w in cfg["decode"]] == [f"http://embedded-cpu-2p1d-{dns.format('decode-0')}:8101"]
    assert cfg["block_size"] == 128 and cfg["mode"] == "pd-bidir"  # vLLM's CPU block size
    services = {o["metadata"]["name"] for o in objects if o["kind"] == "Service"}
    assert {"embedded-cpu-2p1d-pd-bidir-prefill-1", "embedded-cpu-2p1d-pd-bidir-proxy"} <= services
    proxy = container(objects, "Deployment", "embedded-cpu-2p1d-pd-bidir-proxy")
    assert proxy["command"] + proxy["args"] == ["python3", "-m", "serving.proxy_server", "/etc/turnscope/proxy.json",
                                                "--host", "0.0.0.0", "--port", "8200"]


def test_gpu_workers_request_their_gpus_and_block_size() -> None:
    objects = kube.render_objects(load_topology(REPO / "data/topologies/vendor-h200-1p1d.yaml"), "pd", OPTIONS)
    p = container(objects, "Deployment", "vendor-h200-1p1d-pd-prefill-0")
    assert p["resources"] == {"limits": {"nvidia.com/gpu": 8}}  # gpus: "0,1,2,3,4,5,6,7"
    assert "CUDA_VISIBLE_DEVICES" not in env_of(p) and env_of(p)["FI_PROVIDER"]["value"] == "efa"
    assert proxy_config(objects)["block_size"] == 16  # vLLM's default on GPUs


def with_keys(topo: Topology, prefill: SecretRef, decode: SecretRef, proxy: SecretRef) -> Topology:
    roles = {r: topo.roles[r].model_copy(update={"api_key": ref}) for r, ref in (("prefill", prefill),
                                                                                 ("decode", decode))}
    return topo.model_copy(update={"roles": topo.roles | roles,
                                   "proxy": topo.proxy.model_copy(update={"api_key": proxy})})


def test_api_keys_come_from_the_secret_never_the_output(monkeypatch, tmp_path) -> None:
    canary_env, canary_file = "canary-key-4f1d9e", "canary-key-file-77ab"
    monkeypatch.setenv("TS_P_KEY", canary_env)
    monkeypatch.setenv("TS_D_KEY", canary_env)
    (tmp_path / "proxy-key").write_text(canary_file)
    topo = with_keys(load_topology(REPO / "data/topologies/embedded-cpu.yaml"), SecretRef(env="TS_P_KEY"),
                     SecretRef(env="TS_D_KEY"), SecretRef(file=str(tmp_path / "proxy-key")))
    text = kube.render(topo, "pd-bidir", OPTIONS)
    assert canary_env not in text and canary_file not in text
    objects = [o for o in yaml.safe_load_all(text) if o]
    for obj in objects:
        validate(obj)
    for role in ("prefill", "decode"):
        env = env_of(container(objects, "Deployment", f"embedded-cpu-pd-bidir-{role}-0"))
        assert env["VLLM_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "embedded-cpu-api-keys", "key": role}}
    proxy = container(objects, "Deployment", "embedded-cpu-pd-bidir-proxy")
    assert env_of(proxy)["TS_P_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "embedded-cpu-api-keys", "key": "prefill"}
    assert env_of(proxy)["TS_D_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "decode"
    assert {"name": "api-keys", "mountPath": str(tmp_path / "proxy-key"), "subPath": "proxy",
            "readOnly": True} in proxy["volumeMounts"]
    assert ("kubectl create secret generic embedded-cpu-api-keys -n default --from-literal=prefill=\"$TS_P_KEY\" "
            f"--from-literal=decode=\"$TS_D_KEY\" --from-file=proxy={tmp_path / 'proxy-key'}") in text
    assert all(o["kind"] != "Secret" for o in objects)


def test_aggregated_needs_no_prefill_key() -> None:
    topo = load_topology(REPO / "data/topologies/embedded-cpu.yaml")
    topo = topo.model_copy(update={"roles": topo.roles | {"prefill": RoleSettings(api_key=SecretRef(env="X"))}})
    assert kube.secret_command(topo, "aggregated") is None
    assert "VLLM_API_KEY" not in json.dumps(kube.render_objects(topo, "aggregated", OPTIONS))


def test_stock_vllm_entry_runs_the_stock_image() -> None:
    topo = load_topology(REPO / "data/topologies/vendor-h200-1p1d.yaml")
    topo = topo.model_copy(update={"roles": topo.roles | {"prefill": topo.roles["prefill"].model_copy(
        update={"entry": "vllm"})}})
    objects = kube.render_objects(topo, "pd", OPTIONS)
    p = container(objects, "Deployment", "vendor-h200-1p1d-pd-prefill-0")
    assert p["image"] == "vllm/vllm-openai:v0.32.0" and p["command"][2].startswith("vllm.")
    assert container(objects, "Deployment", "vendor-h200-1p1d-pd-decode-0")["image"] == IMAGE


def test_no_image_is_refused_naming_the_option() -> None:
    with pytest.raises(kube.KubernetesError, match="--image"):
        kube.render_objects(load_topology(REPO / "data/topologies/embedded-cpu.yaml"), "pd", kube.KubeOptions())


def test_multi_node_workers_are_leader_worker_sets() -> None:
    topo = load_topology(REPO / "data/topologies/vendor-h200-1p1d.yaml")
    objects = kube.render_objects(topo, "pd-bidir", kube.KubeOptions(image=IMAGE, nodes_per_worker=2))
    for obj in objects:
        validate(obj)
    lws = by_kind_name(objects)[("LeaderWorkerSet", "vendor-h200-1p1d-pd-bidir-decode-0")]
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2
    leader = group["leaderTemplate"]["spec"]["containers"][0]
    worker = group["workerTemplate"]["spec"]["containers"][0]
    assert leader["args"][-6:] == ["--nnodes", "2", "--master-addr", "$(LWS_LEADER_ADDRESS)", "--node-rank", "0"]
    assert worker["args"][-3:] == ["--node-rank", "$(LWS_WORKER_INDEX)", "--headless"]
    assert "readinessProbe" not in worker and [p["name"] for p in worker["ports"]] == ["nixl"]
    svc = by_kind_name(objects)[("Service", "vendor-h200-1p1d-pd-bidir-decode-0")]
    assert svc["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"


def test_pipeline_parallel_args_make_a_leader_worker_set() -> None:
    topo = load_topology(REPO / "data/topologies/vendor-h200-aggregated.yaml")
    role = topo.roles["aggregated"]
    topo = topo.model_copy(update={"roles": {"aggregated": role.model_copy(
        update={"args": [*role.args, "--pipeline-parallel-size", "2"]})}})
    kinds = [o["kind"] for o in kube.render_objects(topo, "aggregated", OPTIONS)]
    assert kinds.count("LeaderWorkerSet") == 1 and kinds.count("Deployment") == 1  # the proxy's


def test_attached_workers_get_only_the_proxy() -> None:
    """launch: false (e.g. vLLM pods another chart deployed): the proxy goes to the workers' own URLs."""
    topo = load_topology(REPO / "data/topologies/vendor-h200-1p1d.yaml")
    p = topo.prefill[0].model_copy(update={"url": "http://llm-p.llm.svc:8000"})
    d = topo.decode[0].model_copy(update={"url": "http://llm-d.llm.svc:8000"})
    topo = topo.model_copy(update={"launch": False, "attached_mode": "pd", "prefill": [p], "decode": [d]})
    objects = kube.render_objects(topo, "pd", OPTIONS)
    for obj in objects:
        validate(obj)
    assert [o["kind"] for o in objects] == ["ConfigMap", "Deployment", "Service", "PodMonitor"]
    cfg = proxy_config(objects)
    assert [w["url"] for w in cfg["prefill"] + cfg["decode"]] == ["http://llm-p.llm.svc:8000", "http://llm-d.llm.svc:8000"]
