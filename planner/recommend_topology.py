"""A recommended setting as a topology file (``data/topologies/*.yaml``, read by
:func:`serving.topology.load_topology`): the current deployment's topology with the setting's knobs
put in, and the diff of the two files, current -> recommended.

Knobs and where a topology holds them:

* ``kv_recompute_threshold``, ``decoder_kv_blocks_ttl``: ``connector`` (both roles'
  ``--kv-transfer-config``, in the bidirectional modes);
* prefill and decode workers: the ``prefill`` and ``decode`` lists (a worker added copies the last
  one's host, cores and GPUs, on the next free port and side-channel port: place it before use);
* routing: ``proxy.prefill_routing``;
* D's KV space: ``--kv-cache-memory-bytes`` in ``roles.decode.args`` (a role's args come after the
  topology's ``kv_cache_bytes`` on the command line, so the last flag wins in vLLM's parser);
* the strategy: the serving mode it runs as (``attached_mode`` for an attached deployment, else a
  comment naming ``--modes``): a topology serves every mode, the mode is chosen per run;
* a host tier (``pd+host``, ``pd-bidir+host``): P's whole ``--kv-transfer-config`` (NixlConnector and
  OffloadingConnector under MultiConnector, :func:`planner.serve_flags.role_argv`) in
  ``roles.prefill.args``: it follows the one turnscope renders from the connector, and vLLM's parser
  keeps the last of a repeated flag (``FlexibleArgumentParser.parse_args`` warns "Found duplicate
  keys"), so it holds for the strategy's mode only (a comment says which).
"""

from __future__ import annotations

import difflib

import yaml

from core.contract import WORKER_ROLES, Role
from planner.serve_flags import role_argv
from planner.strategies import HOST_STRATEGIES, STRATEGIES
from serving.topology import RoleSettings, Topology, WorkerEntry, embedded_topology

KV_FLAG = "--kv-cache-memory-bytes"
TRANSFER_FLAG = "--kv-transfer-config"


def default_topology(model: str, platform: str) -> Topology:
    """The topology to diff against when the user gives none: the embedded default on ``cpu``, a
    1P1D GPU layout (hosts ``prefill-0`` and ``decode-0``: replace them) on ``gpu``."""
    if platform == "cpu":
        return embedded_topology(model)
    return Topology(name="recommended-1p1d", model=model, platform="gpu",
                    prefill=[WorkerEntry(host="prefill-0", port=8100, side_channel_port=5600)],
                    decode=[WorkerEntry(host="decode-0", port=8100, side_channel_port=5600)])


def _resized(workers: list[WorkerEntry], n: int, taken: set[tuple[str, int]]) -> list[WorkerEntry]:
    out = [w.model_copy(deep=True) for w in workers[:n]]
    while len(out) < n:
        last = out[-1]
        port = last.port + 1
        while (last.host, port) in taken:
            port += 1
        taken.add((last.host, port))
        side = (last.side_channel_port or 5600) + 1
        while (last.host, side) in taken:
            side += 1
        taken.add((last.host, side))
        out.append(last.model_copy(update={"port": port, "side_channel_port": side}))
    return out


def read_base(path) -> Topology:
    """The topology file at ``path`` as the diff's base (:func:`serving.topology.load_topology`), its
    ``model`` kept as the file writes it (the loader resolves a relative one against the file).
    Raises serving.topology.TopologyError naming the file and field."""
    from pathlib import Path

    from core import yaml_file
    from serving.topology import TopologyError, load_topology

    topo = load_topology(Path(path))
    topo.model = str(yaml_file.read_mapping(Path(path), "topology", TopologyError)["model"])
    return topo


def model_seen_from(base_path, out_path) -> str:
    """The base topology file's ``model`` as a file written at ``out_path`` must name it: an absolute
    path (or a served name) as written; a relative one, which :func:`serving.topology.load_topology`
    resolves against the file holding it, re-expressed relative to ``out_path``'s folder so that the
    written file loads the same model wherever it is written. Raises serving.topology.TopologyError."""
    import os
    from pathlib import Path

    from core import yaml_file
    from serving.topology import TopologyError, load_topology

    raw = str(yaml_file.read_mapping(Path(base_path), "topology", TopologyError)["model"])
    if Path(raw).is_absolute():
        return raw
    resolved = load_topology(Path(base_path)).model
    if not Path(resolved).is_absolute():
        return raw
    return os.path.relpath(resolved, Path(out_path).resolve().parent)


def _drop_flag(args: list[str], flag: str) -> list[str]:
    args = list(args)
    while flag in args:
        i = args.index(flag)
        del args[i:i + 2]
    return args


def topology_for(base: Topology, setting, host_kv_bytes: float | None = None) -> Topology:
    """``base`` with the knobs of ``setting`` (a :class:`planner.recommend.Setting`) put in
    (see the module doc; ``host_kv_bytes``: one P's host tier, for the host strategies). Raises
    ValueError when ``base`` has no prefill/decode workers, or a host strategy has no host tier."""
    if not (base.prefill and base.decode):
        raise ValueError(f"topology {base.name!r} has no prefill and decode workers: the recommendation is P/D")
    taken = {(w.host, p) for role in WORKER_ROLES for w in getattr(base, role)
             for p in (w.port, w.side_channel_port) if p}
    roles = {k: v.model_copy(deep=True) for k, v in base.roles.items()}
    if setting.decode_kv_bytes is not None:
        dec = roles.get(Role.DECODE) or RoleSettings()
        roles[Role.DECODE] = dec.model_copy(update={"args": [*_drop_flag(dec.args, KV_FLAG), KV_FLAG,
                                                          str(int(setting.decode_kv_bytes))]})
    connector = base.connector.model_copy(update={"kv_recompute_threshold": int(setting.threshold),
                                                  "decoder_kv_blocks_ttl": int(setting.ttl_s)})
    pre = roles.get(Role.PREFILL) or RoleSettings()
    pre_args = _drop_flag(pre.args, TRANSFER_FLAG)
    if setting.strategy in HOST_STRATEGIES:
        if not host_kv_bytes:
            raise ValueError(f"strategy {setting.strategy!r} needs a host tier (the profile's host_kv_space_bytes)")
        argv = role_argv(setting, Role.PREFILL, base.model, host_kv_bytes, base.platform, base.connector)
        pre_args += [TRANSFER_FLAG, argv[argv.index(TRANSFER_FLAG) + 1]]
    if pre_args or Role.PREFILL in roles:
        roles[Role.PREFILL] = pre.model_copy(update={"args": pre_args})
    update = {"connector": connector,
              "prefill": _resized(base.prefill, setting.prefill_workers, taken),
              "decode": _resized(base.decode, setting.decode_workers, taken),
              "proxy": base.proxy.model_copy(update={"prefill_routing": setting.routing}),
              "roles": roles}
    if not base.launch:
        update["attached_mode"] = STRATEGIES[setting.strategy]
    return Topology.model_validate(base.model_copy(update=update).model_dump())


def topology_yaml(topo: Topology, setting, base: Topology | None = None) -> str:
    """``topo`` as a topology file (fields at their defaults left out, but the connector and the
    proxy's routing always written), headed by comments naming the mode to run, a host tier, and
    the workers added to ``base``'s."""
    data = topo.model_dump(mode="json", exclude_defaults=True, exclude_none=True)
    data["connector"] = topo.connector.model_dump(mode="json", exclude_none=True)
    data["proxy"] = {**data.get("proxy", {}), "prefill_routing": topo.proxy.prefill_routing}
    mode = STRATEGIES[setting.strategy]
    head = [f"# strategy {setting.strategy}: serving mode {mode} (turnscope eval --topology THIS_FILE --modes {mode})"]
    for role, n in ((Role.PREFILL, setting.prefill_workers), (Role.DECODE, setting.decode_workers)):
        had = len(getattr(base, role)) if base is not None else n
        if n > had:
            head.append(f"# {role}[{had}:]: a worker added copies the last one's host, cores and GPUs on the next free "
                        "ports: give each its own node or devices")
    if setting.strategy in HOST_STRATEGIES:
        head.append(f"# host tier: roles.prefill.args carries P's whole --kv-transfer-config (MultiConnector: NixlConnector "
                    f"+ OffloadingConnector), after turnscope's: valid for mode {mode} only")
    return "\n".join(head) + "\n" + yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=4096)


def topology_diff(base: Topology, current, recommended, host_kv_bytes: float | None = None) -> tuple[str, str]:
    """(the recommended topology file's text, the unified diff current -> recommended; empty when
    equal). ``host_kv_bytes``: one P's host tier (the host strategies)."""
    cur = topology_yaml(topology_for(base, current, host_kv_bytes), current, base)
    rec = topology_yaml(topology_for(base, recommended, host_kv_bytes), recommended, base)
    diff = "\n".join(difflib.unified_diff(cur.splitlines(), rec.splitlines(), "current topology",
                                          "recommended topology", lineterm="", n=3))
    return rec, diff
