"""serving.kubernetes: every shipped topology's every mode renders objects that the Kubernetes
schemas accept, and the facts that matter hold (worked out by hand from the topology files).

Validators: core objects (Deployment, Service, ConfigMap, and a LeaderWorkerSet's pod templates as
v1 PodTemplates) with ``kubernetes-validate`` (the official OpenAPI schemas of Kubernetes 1.31,
strict: no unknown field); the PodMonitor with ``cloudcoil-models-prometheus-operator`` (pydantic
models generated from Prometheus Operator v0.80.1's CRDs; a field its schema lacks is dropped on
load, so the object must come back unchanged); the InferencePool against the openAPI schema of the
Gateway API Inference Extension's v1 CRD, vendored in tests/data/crds (no package ships it; its
source is named there), strict as well (:func:`undeclared_fields`: the API server would prune a
field its schema lacks), with the CRD's two CEL rules checked by hand. The LeaderWorkerSet's own
fields (size, restart policy) are not validated: its CRD's schema is not shipped by any package
here (docs/kubernetes.md). Beside the schemas, every pod template is checked for what they cannot
express (:func:`check_pod_spec`): unique volume names, unique mount paths per container, mounts of
declared volumes, unique environment names.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
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
CRDS = REPO / "tests" / "data" / "crds"


def crd_schema(path: Path, version: str) -> dict:
    """The openAPI schema of ``version`` in the CRD file ``path``."""
    crd = yaml.safe_load(path.read_text())
    return next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]


INFERENCE_POOL_SCHEMA = crd_schema(CRDS / "inferencepools.inference.networking.k8s.io.yaml", "v1")


def undeclared_fields(obj: object, schema: dict, where: str = "") -> list[str]:
    """Fields of ``obj`` that the structural ``schema`` does not declare (the API server drops them
    on admission, so an object that depends on one would not do what it says). An object schema
    without ``properties`` (``metadata``) or with ``additionalProperties`` accepts any key."""
    if isinstance(obj, dict) and "properties" in schema:
        return [f for key, value in obj.items()
                for f in ([f"{where}.{key}"] if key not in schema["properties"]
                          else undeclared_fields(value, schema["properties"][key], f"{where}.{key}"))]
    if isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        return [f for key, value in obj.items()
                for f in undeclared_fields(value, schema["additionalProperties"], f"{where}.{key}")]
    if isinstance(obj, list) and "items" in schema:
        return [f for i, item in enumerate(obj) for f in undeclared_fields(item, schema["items"], f"{where}[{i}]")]
    return []


def validate_inference_pool(obj: dict) -> None:
    """The InferencePool against its vendored CRD schema (module doc), and the CRD's CEL rules
    (``x-kubernetes-validations``), which JSON Schema cannot state: a Service endpoint picker names
    its port, and target port numbers are unique."""
    jsonschema.validate(obj, INFERENCE_POOL_SCHEMA)
    assert undeclared_fields(obj, INFERENCE_POOL_SCHEMA) == []
    epp = obj["spec"]["endpointPickerRef"]
    assert epp.get("kind", "Service") != "Service" or "port" in epp, "port is required when kind is Service"
    numbers = [p["number"] for p in obj["spec"]["targetPorts"]]
    assert len(numbers) == len(set(numbers)), "port number must be unique"


def pod_specs(obj: dict) -> list[dict]:
    """Every pod spec of a rendered workload (a Deployment's template, a LeaderWorkerSet's two)."""
    if obj["kind"] == "Deployment":
        return [obj["spec"]["template"]["spec"]]
    if obj["kind"] == "LeaderWorkerSet":
        group = obj["spec"]["leaderWorkerTemplate"]
        return [group["leaderTemplate"]["spec"], group["workerTemplate"]["spec"]]
    return []


def check_pod_spec(spec: dict) -> None:
    """What the API server refuses and the schemas do not say: two volumes of one name, two mounts
    at one path in a container, a mount of an undeclared volume; and two environment variables of
    one name in a container (the later one silently wins)."""
    volumes = [v["name"] for v in spec.get("volumes", [])]
    assert len(volumes) == len(set(volumes)), f"volume names repeat: {volumes}"
    for c in spec["containers"]:
        paths = [m["mountPath"] for m in c.get("volumeMounts", [])]
        assert len(paths) == len(set(paths)), f"container {c['name']}: mount paths repeat: {paths}"
        assert {m["name"] for m in c.get("volumeMounts", [])} <= set(volumes), c["volumeMounts"]
        names = [e["name"] for e in c.get("env", [])]
        assert len(names) == len(set(names)), f"container {c['name']}: environment names repeat: {names}"


def validate(obj: dict) -> None:
    """Validate one rendered object with the validator of its kind (module doc)."""
    for spec in pod_specs(obj):
        check_pod_spec(spec)
    if obj["kind"] == "PodMonitor":
        assert PodMonitor.model_validate(obj).model_dump(by_alias=True, exclude_unset=True, mode="json") == obj
    elif obj["kind"] == "InferencePool":
        validate_inference_pool(obj)
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
    assert "InferencePool" not in kinds  # only when asked for
    pool = kube.render_objects(load_topology(path), mode, kube.KubeOptions(image=IMAGE, inference_pool_epp="epp"))
    assert [o["kind"] for o in pool] == [*kinds, "InferencePool"]
    validate(pool[-1])


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


def test_roles_reading_one_key_file_mount_it_once() -> None:
    """prefill and decode both read /run/secrets/vllm-key: the proxy mounts that path once (two mounts
    at one path are refused by the API server), and the kubectl line fills both keys from the file."""
    shared = SecretRef(file="/run/secrets/vllm-key")
    topo = with_keys(load_topology(REPO / "data/topologies/embedded-cpu.yaml"), shared, shared, None)
    objects = kube.render_objects(topo, "pd-bidir", OPTIONS)
    for obj in objects:
        validate(obj)
    proxy = container(objects, "Deployment", "embedded-cpu-pd-bidir-proxy")
    keys = [m for m in proxy["volumeMounts"] if m["name"] == "api-keys"]
    assert keys == [{"name": "api-keys", "mountPath": "/run/secrets/vllm-key", "subPath": "prefill", "readOnly": True}]
    assert kube.secret_command(topo, "pd-bidir") == (
        "kubectl create secret generic embedded-cpu-api-keys -n default "
        "--from-file=prefill=/run/secrets/vllm-key --from-file=decode=/run/secrets/vllm-key")


def test_roles_reading_one_key_variable_set_it_once() -> None:
    shared = SecretRef(env="VLLM_KEY")
    topo = with_keys(load_topology(REPO / "data/topologies/embedded-cpu.yaml"), shared, shared, None)
    proxy = container(kube.render_objects(topo, "pd", OPTIONS), "Deployment", "embedded-cpu-pd-proxy")
    assert [e["name"] for e in proxy["env"]] == ["VLLM_KEY"]


def test_the_pod_checks_have_teeth() -> None:
    """Each check of check_pod_spec fails on a planted fault."""
    objects = kube.render_objects(load_topology(REPO / "data/topologies/embedded-cpu.yaml"), "pd", OPTIONS)
    spec = by_kind_name(objects)[("Deployment", "embedded-cpu-pd-proxy")]["spec"]["template"]["spec"]
    check_pod_spec(spec)
    plants = [lambda s: s["containers"][0]["volumeMounts"].append({"name": "config", "mountPath": "/etc/turnscope"}),
              lambda s: s["volumes"].append({"name": "config", "emptyDir": {}}),
              lambda s: s["containers"][0]["volumeMounts"].append({"name": "nowhere", "mountPath": "/x"}),
              lambda s: s["containers"][0]["env"].extend([{"name": "A", "value": "1"}, {"name": "A", "value": "2"}])]
    for plant in plants:
        bad = json.loads(json.dumps(spec))
        plant(bad)
        with pytest.raises(AssertionError):
            check_pod_spec(bad)


def test_inference_pool_selects_the_proxy_and_names_its_picker() -> None:
    topo = load_topology(REPO / "data/topologies/embedded-cpu.yaml")
    objects = kube.render_objects(topo, "pd-bidir", kube.KubeOptions(image=IMAGE, namespace="llm",
                                                                      inference_pool_epp="my-epp:9010"))
    pool = objects[-1]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["metadata"]["namespace"] == "llm"
    assert pool["spec"]["targetPorts"] == [{"number": 8200}]  # embedded-cpu.yaml's proxy port
    assert pool["spec"]["endpointPickerRef"] == {"name": "my-epp", "kind": "Service", "port": {"number": 9010}}
    assert pool["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "turnscope", "app.kubernetes.io/instance": "embedded-cpu-pd-bidir",
        "app.kubernetes.io/component": "proxy"}
    default = kube.render_objects(topo, "pd", kube.KubeOptions(image=IMAGE, inference_pool_epp="my-epp"))[-1]
    assert default["spec"]["endpointPickerRef"]["port"] == {"number": 9002}
    for bad in ("My_EPP", "epp:0", "epp:http", ":9002"):
        with pytest.raises(kube.KubernetesError, match="--inference-pool"):
            kube.render_objects(topo, "pd", kube.KubeOptions(image=IMAGE, inference_pool_epp=bad))


def test_the_inference_pool_schema_check_has_teeth() -> None:
    """The vendored CRD's schema refuses a planted unknown field, a missing selector, a port out of
    range; the hand-checked CEL rules refuse a Service picker without a port and repeated ports."""
    good = kube.render_objects(load_topology(REPO / "data/topologies/embedded-cpu.yaml"), "pd",
                               kube.KubeOptions(image=IMAGE, inference_pool_epp="epp"))[-1]
    validate_inference_pool(good)
    plants = [lambda p: p["spec"].__setitem__("targetPortNumber", 8200),      # the pre-v1 field
              lambda p: p["spec"].pop("selector"),
              lambda p: p["spec"]["targetPorts"].__setitem__(0, {"number": 70000}),
              lambda p: p["spec"]["endpointPickerRef"].pop("port"),
              lambda p: p["spec"]["targetPorts"].append({"number": 8200})]
    for plant in plants:
        bad = json.loads(json.dumps(good))
        plant(bad)
        with pytest.raises((AssertionError, jsonschema.ValidationError)):
            validate_inference_pool(bad)


def test_drain_and_grace_follow_the_proxy_timeouts() -> None:
    """embedded-cpu.yaml's proxy waits prefill_timeout_s / decode_timeout_s (defaults 30 / 300 s, set
    here to 45.5 / 120): P drains 46 s (whole seconds up), D 120 s, the proxy both legs (166 s); each
    pod's grace adds the 30 s teardown; a --shutdown-timeout in the role's args wins, grace included."""
    topo = load_topology(REPO / "data/topologies/embedded-cpu.yaml")
    topo = topo.model_copy(update={"proxy": topo.proxy.model_copy(update={"prefill_timeout_s": 45.5,
                                                                          "decode_timeout_s": 120.0})})
    objects = kube.render_objects(topo, "pd", OPTIONS)
    want = {"prefill-0": (46, 76), "decode-0": (120, 150)}
    for worker, (drain, grace) in want.items():
        d = by_kind_name(objects)[("Deployment", f"embedded-cpu-pd-{worker}")]["spec"]["template"]["spec"]
        args = d["containers"][0]["args"]
        assert args[args.index("--shutdown-timeout") + 1] == str(drain) and d["terminationGracePeriodSeconds"] == grace
        assert "--disable-uvicorn-access-log" not in args
        assert args[args.index("--disable-access-log-for-endpoints") + 1] == "/health,/metrics"
    proxy = by_kind_name(objects)[("Deployment", "embedded-cpu-pd-proxy")]["spec"]["template"]["spec"]
    assert proxy["terminationGracePeriodSeconds"] == 166 + 30
    role = topo.roles["decode"]
    topo = topo.model_copy(update={"roles": topo.roles | {"decode": role.model_copy(
        update={"args": [*role.args, "--shutdown-timeout", "600"]})}})
    d = by_kind_name(kube.render_objects(topo, "pd", OPTIONS))[("Deployment", "embedded-cpu-pd-decode-0")]
    spec = d["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] == 630 and spec["containers"][0]["args"][-2:] == ["--shutdown-timeout", "600"]
