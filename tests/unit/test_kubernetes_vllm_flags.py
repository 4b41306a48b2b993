"""The flags ``--kubernetes`` gives the workers mean, to the installed vLLM, what docs/kubernetes.md says.

Every rendered worker's ``args`` are parsed by vLLM's own server parser (the one
``vllm.entrypoints.launchers.api_server.entry`` builds: ``make_arg_parser``), so a flag this vLLM
lacks fails here; then the drain (``shutdown_timeout``) must be what the topology's proxy
timeouts give, and the access log must be on except for ``/health`` and ``/metrics``: the uvicorn
log configuration vLLM builds from those args (``get_uvicorn_log_config``) is fed uvicorn access
records (its format: ``'%s - "%s %s HTTP/%s" %d'``) and must drop exactly the probes' and scrapes'.
"""

from __future__ import annotations

import logging
import math

import pytest

from serving import kubernetes as kube
from serving.topology import load_topology
from tests.unit.test_kubernetes import CASES, OPTIONS


@pytest.fixture(scope="module")
def vllm_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def access_record(path: str) -> logging.LogRecord:
    """An access-log record as uvicorn's access logger makes it."""
    return logging.LogRecord("uvicorn.access", logging.INFO, "h11_impl.py", 1, '%s - "%s %s HTTP/%s" %d',
                             ("10.0.0.7:51234", "GET", path, "1.1", 200), None)


def containers(objects: list[dict]):
    """(workload name, container) of every worker pod that serves HTTP (a LeaderWorkerSet's leader)."""
    for o in objects:
        if o["kind"] == "Deployment" and not o["metadata"]["name"].endswith("-proxy"):
            yield o["metadata"]["name"], o["spec"]["template"]["spec"]["containers"][0]
        elif o["kind"] == "LeaderWorkerSet":
            yield o["metadata"]["name"], o["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]


def test_every_rendered_worker_parses_and_drains_quietly(vllm_parser) -> None:
    from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config

    seen, expected = 0, 0
    for path, mode in CASES:
        topo = load_topology(path)
        expected += len(topo.aggregated) if mode == "aggregated" else len(topo.prefill) + len(topo.decode)
        for name, c in containers(kube.render_objects(topo, mode, OPTIONS)):
            args = vllm_parser.parse_args(c["args"])
            legs = {"prefill": topo.proxy.prefill_timeout_s, "decode": topo.proxy.decode_timeout_s,
                    "aggregated": topo.proxy.decode_timeout_s}
            role = next(r for r in legs if f"-{r}-" in name)
            assert args.shutdown_timeout == math.ceil(legs[role]), name
            assert args.disable_uvicorn_access_log is False
            log_config = get_uvicorn_log_config(args)
            spec = dict(log_config["filters"]["access_log_filter"])
            access_filter = spec.pop("()")(**spec)
            kept = {p: access_filter.filter(access_record(p))
                    for p in ("/health", "/metrics", "/metrics?x=1", "/v1/completions", "/v1/chat/completions")}
            assert kept == {"/health": False, "/metrics": False, "/metrics?x=1": False,
                            "/v1/completions": True, "/v1/chat/completions": True}, name
            assert "access_log_filter" in log_config["handlers"]["access"]["filters"]
            seen += 1
    assert seen == expected  # every worker of every shipped topology's every mode
