"""A setting's ``vllm serve`` flags per role (the recommendation's flags diff, and P's transfer
config in a recommended topology file), rendered by :func:`serving.workers.worker_command`, the
command turnscope itself starts workers with."""

from __future__ import annotations

import json

from core.connector import Connector
from core.contract import Role
from core.modes import serving_mode
from planner.strategies import BIDIR_STRATEGIES, HOST_STRATEGIES, STRATEGIES
from serving.workers import WorkerSpec, worker_command


def role_argv(s, role: str, model: str, host_kv_bytes: float | None, platform: str = "gpu",
              connector: Connector | None = None) -> list[str]:
    """``vllm serve`` arguments (after ``vllm serve``) of one ``role`` (prefill, decode) in ``s`` (a
    :class:`planner.recommend.Setting`),
    rendered by :func:`serving.workers.worker_command` on ``platform`` (gpu, cpu); a host tier on P wraps
    the NixlConnector and vLLM's OffloadingConnector (``cpu_bytes_to_use``) in ``MultiConnector``.
    ``connector``: the deployment's connector settings (a topology's: backends, buffer device...;
    None: vLLM's defaults), the setting's threshold and TTL put in."""
    bidir = s.strategy in BIDIR_STRATEGIES
    spec = WorkerSpec(name=role, role=role, host="0.0.0.0", port=8100 if role == Role.PREFILL else 8200, model=model,
                      platform=platform, nixl=True, bidirectional=bidir,
                      prefix_caching=serving_mode(STRATEGIES[s.strategy]).prefix_caching(role),
                      connector=(connector or Connector()).model_copy(update={
                          "kv_recompute_threshold": s.threshold, "decoder_kv_blocks_ttl": int(s.ttl_s)}),
                      kv_cache_bytes=int(s.decode_kv_bytes) if role == Role.DECODE and s.decode_kv_bytes else None)
    argv, _ = worker_command(spec)
    argv = argv[argv.index("--model"):]
    if role == Role.PREFILL and s.strategy in HOST_STRATEGIES and host_kv_bytes:
        i = argv.index("--kv-transfer-config") + 1
        nixl = json.loads(argv[i])
        offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"cpu_bytes_to_use": int(host_kv_bytes)}}
        argv[i] = json.dumps({"kv_connector": "MultiConnector", "kv_role": "kv_both",
                              "kv_buffer_device": nixl["kv_buffer_device"],
                              "kv_load_failure_policy": nixl["kv_load_failure_policy"],
                              "kv_connector_extra_config": {"connectors": [nixl, offload]}})
    return argv
