"""serving.kubernetes: every selector selects exactly the pods it is meant to, among all the pods of
several modes rendered into one namespace (the case the names are built for).

The pods are the ones the controllers would make from the rendered workloads: a Deployment's
``replicas`` pods with its template's labels; a LeaderWorkerSet's ``size`` pods, the leader from
``leaderTemplate`` and the others from ``workerTemplate``, each with the labels the LWS controller
adds (``leaderworkerset.sigs.k8s.io/name`` and ``/worker-index``, kubernetes-sigs/lws
``api/leaderworkerset/v1``). A selector matches a pod when its ``matchLabels`` (a Service's
``selector``) are a subset of the pod's labels (Kubernetes' label-selector semantics). What each
selector is meant to select is written out below from the topology files, by worker name.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from serving import kubernetes as kube
from serving.topology import load_topology
from tests.unit.test_kubernetes import IMAGE, REPO, validate

LWS_NAME, LWS_INDEX = "leaderworkerset.sigs.k8s.io/name", "leaderworkerset.sigs.k8s.io/worker-index"
LLMD_ROLE = "llm-d.ai/role"


@dataclass(frozen=True)
class Pod:
    """One pod a controller makes: its workload (kind, name), its index there, labels and port names."""

    owner: tuple[str, str]
    index: int
    labels: tuple[tuple[str, str], ...]
    ports: frozenset[str]

    @property
    def label_map(self) -> dict[str, str]:
        return dict(self.labels)


def _pod(owner: tuple[str, str], index: int, template: dict, extra: dict[str, str]) -> Pod:
    ports = frozenset(p["name"] for c in template["spec"]["containers"] for p in c.get("ports", []))
    return Pod(owner, index, tuple(sorted((template["metadata"]["labels"] | extra).items())), ports)


def pods_of(objects: list[dict]) -> list[Pod]:
    """The pods the rendered workloads make (module doc)."""
    pods = []
    for o in objects:
        owner = (o["kind"], o["metadata"]["name"])
        if o["kind"] == "Deployment":
            pods += [_pod(owner, i, o["spec"]["template"], {}) for i in range(o["spec"]["replicas"])]
        elif o["kind"] == "LeaderWorkerSet":
            group = o["spec"]["leaderWorkerTemplate"]
            for i in range(group["size"]):
                template = group["leaderTemplate"] if i == 0 else group["workerTemplate"]
                pods.append(_pod(owner, i, template, {LWS_NAME: o["metadata"]["name"], LWS_INDEX: str(i)}))
    return pods


def selected(selector: dict[str, str], pods: list[Pod]) -> set[tuple[str, int]]:
    """``(workload name, index)`` of the pods whose labels include every pair of ``selector``."""
    assert selector, "an empty selector selects every pod of the namespace"
    return {(p.owner[1], p.index) for p in pods if selector.items() <= p.label_map.items()}


def selector_of(obj: dict) -> dict[str, str]:
    kind = obj["kind"]
    if kind == "Service":
        return obj["spec"]["selector"]
    if kind in ("Deployment", "PodMonitor", "InferencePool"):
        return obj["spec"]["selector"]["matchLabels"]
    raise AssertionError(f"no selector in a {kind}")


#: (topology file, nodes per worker): every mode of a topology shares the namespace; every shipped
#: topology, and one with its workers spanning two nodes (LeaderWorkerSets)
NAMESPACES = {path.stem: (path.name, None) for path in sorted((REPO / "data" / "topologies").glob("*.yaml"))} | {
    "vendor-h200-1p1d multi-node": ("vendor-h200-1p1d.yaml", 2)}


def render_namespace(file: str, nodes: int | None) -> dict[str, list[dict]]:
    """Every mode of the topology, rendered with an InferencePool, by mode."""
    topo = load_topology(REPO / "data" / "topologies" / file)
    options = kube.KubeOptions(image=IMAGE, nodes_per_worker=nodes, inference_pool_epp="epp")
    return {mode: kube.render_objects(topo, mode, options) for mode in topo.modes()}


def worker_names(file: str, mode: str) -> dict[str, str]:
    """The workers ``mode`` runs, name -> role, from the topology file's lists (a P/D mode: every
    prefill and decode entry; aggregated: every aggregated entry)."""
    topo = load_topology(REPO / "data" / "topologies" / file)
    roles = ("aggregated",) if mode == "aggregated" else ("prefill", "decode")
    return {f"{role}-{i}": role for role in roles for i in range(len(getattr(topo, role)))}


@pytest.mark.parametrize("ns", list(NAMESPACES))
def test_every_selector_selects_exactly_its_pods(ns: str) -> None:
    file, nodes = NAMESPACES[ns]
    by_mode = render_namespace(file, nodes)
    # several modes in one namespace (all but the aggregated-only topology): selectors keep them apart
    assert len(by_mode) >= 3 or list(by_mode) == ["aggregated"]
    everything = [o for objects in by_mode.values() for o in objects]
    for obj in everything:
        validate(obj)
    pods = pods_of(everything)
    size = nodes or 1
    for mode, objects in by_mode.items():
        instance = f"{file.removesuffix('.yaml')}-{mode}"
        workers = worker_names(file, mode)
        proxy = f"{instance}-proxy"
        # every pod of a worker: index 0 serves HTTP, the others (a LeaderWorkerSet's) are headless
        worker_pods = {w: {(f"{instance}-{w}", i) for i in range(size)} for w in workers}
        mode_pods = set().union(*worker_pods.values()) | {(proxy, 0)}
        objs = {(o["kind"], o["metadata"]["name"]): o for o in objects}
        for w, role in workers.items():
            name = f"{instance}-{w}"
            # the worker's Service: its HTTP-serving pod only (a LeaderWorkerSet's leader)
            service = objs[("Service", name)]
            assert selected(selector_of(service), pods) == {(name, 0)}, (mode, w)
            serving_pod = next(p for p in pods if (p.owner[1], p.index) == (name, 0))
            assert {p["targetPort"] for p in service["spec"]["ports"]} <= serving_pod.ports
            # the workload's own selector: its pods, no other worker's or mode's
            if size == 1:
                assert selected(selector_of(objs[("Deployment", name)]), pods) == worker_pods[w]
            else:
                assert ("LeaderWorkerSet", name) in objs  # its pods are its own by the controller's name label
                assert selected({LWS_NAME: name}, pods) == worker_pods[w]
            # llm-d's role label: on the pod that serves requests, with the role's llm-d value
            want_role = {"prefill": "prefill", "decode": "decode", "aggregated": "both"}[role]
            assert serving_pod.label_map[LLMD_ROLE] == want_role
            assert all(LLMD_ROLE not in p.label_map for p in pods if p.owner[1] == name and p.index > 0)
        # the proxy's Deployment and Service, and the InferencePool: the proxy's pod alone
        assert selected(selector_of(objs[("Deployment", proxy)]), pods) == {(proxy, 0)}
        assert selected(selector_of(objs[("Service", proxy)]), pods) == {(proxy, 0)}
        pool = objs[("InferencePool", proxy)]
        assert selected(selector_of(pool), pods) == {(proxy, 0)}
        proxy_port = objs[("Deployment", proxy)]["spec"]["template"]["spec"]["containers"][0]["ports"][0]
        assert pool["spec"]["targetPorts"] == [{"number": proxy_port["containerPort"]}]
        # the PodMonitor: every pod of the mode; its targets (port http) the HTTP-serving ones
        monitor = objs[("PodMonitor", instance)]
        assert selected(selector_of(monitor), pods) == mode_pods
        port = monitor["spec"]["podMetricsEndpoints"][0]["port"]
        targets = {(p.owner[1], p.index) for p in pods if (p.owner[1], p.index) in mode_pods and port in p.ports}
        assert targets == {(f"{instance}-{w}", 0) for w in workers} | {(proxy, 0)}
        # llm-d's role label selects this mode's workers of that role (with the instance label)
        for role, value in (("prefill", "prefill"), ("decode", "decode"), ("aggregated", "both")):
            with_role = selected({"app.kubernetes.io/instance": instance, LLMD_ROLE: value}, pods)
            assert with_role == {(f"{instance}-{w}", 0) for w, r in workers.items() if r == role}


def test_the_selector_check_has_teeth() -> None:
    """A Service whose selector lost its worker label selects every pod of its role in the mode: caught."""
    by_mode = render_namespace("embedded-cpu-2p1d.yaml", None)
    pods = pods_of([o for objects in by_mode.values() for o in objects])
    service = next(o for o in by_mode["pd"] if o["kind"] == "Service"
                   and o["metadata"]["name"] == "embedded-cpu-2p1d-pd-prefill-0")
    loose = {k: v for k, v in selector_of(service).items() if k != kube.WORKER_LABEL}
    assert selected(loose, pods) == {("embedded-cpu-2p1d-pd-prefill-0", 0), ("embedded-cpu-2p1d-pd-prefill-1", 0)}
    without_instance = {k: v for k, v in selector_of(service).items() if k != kube.INSTANCE_LABEL}
    with_p = [m for m in by_mode if "prefill-0" in worker_names("embedded-cpu-2p1d.yaml", m)]
    assert selected(without_instance, pods) == {(f"embedded-cpu-2p1d-{m}-prefill-0", 0) for m in with_p}
    assert len(with_p) == 4  # pd, pd-nocache, pd-bidir, pd-bidir-nocache: not aggregated
