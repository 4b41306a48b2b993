"""Topology files render into the exact vLLM command lines (flags checked by hand, not by code)."""

import json
from pathlib import Path

import pytest

from serving.topology import TopologyError, embedded_topology, load_topology
from serving.workers import mode_workers, worker_command

TOPOLOGIES = Path(__file__).resolve().parents[2] / "data" / "topologies"


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_vendor_gpu_topology_renders_the_published_setup():
    topo = load_topology(TOPOLOGIES / "vendor-h200-1p1d.yaml")
    p, d = mode_workers("pd-bidir-nocache", topo)
    (p_argv, p_env), (d_argv, d_env) = worker_command(p), worker_command(d)
    assert "--no-enable-prefix-caching" in p_argv and "--enable-prefix-caching" in d_argv
    assert flag(p_argv, "--tensor-parallel-size") == "8" and flag(d_argv, "--tensor-parallel-size") == "8"
    for argv, env, host in ((p_argv, p_env, "10.0.0.11"), (d_argv, d_env, "10.0.0.12")):
        kv = json.loads(flag(argv, "--kv-transfer-config"))
        assert kv["kv_connector"] == "NixlConnector" and kv["kv_buffer_device"] == "cuda"
        extra = kv["kv_connector_extra_config"]
        assert extra["backends"] == ["LIBFABRIC"] and extra["bidirectional_kv_xfer"] is True
        assert (extra["kv_recompute_threshold"], extra["decoder_kv_blocks_ttl"]) == (64, 480)
        assert env["FI_PROVIDER"] == "efa" and env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == host and env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
        assert "VLLM_CPU_OMP_THREADS_BIND" not in env and "TURNSCOPE_NIXL_PROGRESS_DELAY_US" not in env
        assert "TURNSCOPE_ENGINE_IDLE_WAIT_MS" not in env
    # one-way P/D keeps P's prefix cache and has no bidirectional keys
    p1, _ = mode_workers("pd", topo)
    argv, _ = worker_command(p1)
    assert "--enable-prefix-caching" in argv
    assert "bidirectional_kv_xfer" not in json.loads(flag(argv, "--kv-transfer-config"))["kv_connector_extra_config"]
    with pytest.raises(ValueError, match="cannot run mode 'aggregated'"):
        mode_workers("aggregated", topo)


def test_embedded_cpu_topology_file_is_the_embedded_default(tmp_path):
    topo = load_topology(TOPOLOGIES / "embedded-cpu.yaml")
    assert topo == embedded_topology(topo.model)
    assert topo.model.endswith("data/models/turnscope-tiny")
    p, d = mode_workers("pd-bidir", topo)
    p_argv, p_env = worker_command(p)
    _, d_env = worker_command(d)
    assert flag(p_argv, "--kv-cache-memory-bytes") == str(512 * 2**20)
    assert flag(p_argv, "--dtype") == "float32"
    assert (p_env["VLLM_CPU_OMP_THREADS_BIND"], d_env["VLLM_CPU_OMP_THREADS_BIND"]) == ("0", "1")
    assert json.loads(flag(p_argv, "--kv-transfer-config"))["kv_buffer_device"] == "cpu"
    (agg,) = mode_workers("aggregated", topo)
    a_argv, a_env = worker_command(agg)
    assert "--kv-transfer-config" not in a_argv and "--enable-prefix-caching" in a_argv
    # every worker reports its own cache hits; NIXL's progress thread pauses on the CPU NIXL workers only
    assert all("--enable-prompt-tokens-details" in argv for argv in (p_argv, a_argv))
    assert (p_env["TURNSCOPE_NIXL_PROGRESS_DELAY_US"], d_env["TURNSCOPE_NIXL_PROGRESS_DELAY_US"]) == ("100", "100")
    assert "TURNSCOPE_NIXL_PROGRESS_DELAY_US" not in a_env
    # the idle-loop plugin on every CPU worker: the engine loop's wait (NIXL workers) and the model
    # runner's short spin after a step (all of them: the aggregated worker's 1 s spin slowed the
    # P workers sharing its core)
    assert (p_env["TURNSCOPE_ENGINE_IDLE_WAIT_MS"], d_env["TURNSCOPE_ENGINE_IDLE_WAIT_MS"],
            a_env["TURNSCOPE_ENGINE_IDLE_WAIT_MS"]) == ("50", "50", "50")


@pytest.mark.parametrize("text, expected", [
    ("name: x\nmodel: m\nprefill: [{port: 1}]\ndecode: [{port: 2, side_channel_port: 3}]\n",
     r"prefill: Value error, \[0\].side_channel_port is required"),
    ("name: x\nmodel: m\nprefill: [{port: 1, side_channel_port: 5}]\ndecode: [{port: 1, side_channel_port: 6}]\n",
     "decode\\[0\\]: port 1 on 127.0.0.1 is also used by prefill\\[0\\]"),
    ("name: x\nmodel: m\naggregated: [{port: 1}]\nconnector: {kv_recompute_threshold: -1}\n",
     "connector.kv_recompute_threshold: Input should be greater than or equal to 0"),
    ("name: x\nmodel: m\naggregated: [{port: 1, colour: red}]\n", "aggregated.0.colour: Extra inputs"),
    ("name: x\nmodel: [unclosed\n", "line 3, column 1: not valid YAML"),
    ("name: x\nmodel: m\n", "needs prefill and decode workers, or aggregated workers"),
])
def test_invalid_topology_names_file_and_field(tmp_path, text, expected):
    path = tmp_path / "t.yaml"
    path.write_text(text)
    with pytest.raises(TopologyError, match=expected) as err:
        load_topology(path)
    assert str(path) in str(err.value)


def test_vendor_aggregated_baseline_topology():
    """The GPU baseline for the sweep: one aggregated worker, TP 8 on 8 GPUs, prefix caching on, no
    connector; it runs only the aggregated mode."""
    topo = load_topology(TOPOLOGIES / "vendor-h200-aggregated.yaml")
    assert topo.modes() == ["aggregated"] and topo.max_model_len == 32768
    (agg,) = mode_workers("aggregated", topo)
    argv, env = worker_command(agg)
    assert flag(argv, "--tensor-parallel-size") == "8" and "--enable-prefix-caching" in argv
    assert "--kv-transfer-config" not in argv and env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert flag(argv, "--max-model-len") == "32768"
    with pytest.raises(ValueError, match="cannot run mode 'pd'"):
        mode_workers("pd", topo)


def test_embedded_2p1d_topology_shares_core_0_between_the_two_prefill_workers():
    """Two P on core 0 (P's compute as in 1P1D), D alone on core 1, distinct ports and NIXL side
    channels, and the proxy's routing read from the file (docs/configuration.md)."""
    topo = load_topology(TOPOLOGIES / "embedded-cpu-2p1d.yaml")
    p0, p1, d = mode_workers("pd-bidir", topo)
    assert [w.name for w in (p0, p1, d)] == ["prefill-0", "prefill-1", "decode-0"]
    envs = [worker_command(w)[1] for w in (p0, p1, d)]
    assert [e["VLLM_CPU_OMP_THREADS_BIND"] for e in envs] == ["0", "0", "1"]
    assert [e["VLLM_NIXL_SIDE_CHANNEL_PORT"] for e in envs] == ["5600", "5602", "5601"]
    assert [w.port for w in (p0, p1, d)] == [8100, 8103, 8101]
    assert (topo.proxy.prefill_routing, topo.proxy.decode_routing) == ("session", "session")
    assert topo.model == load_topology(TOPOLOGIES / "embedded-cpu.yaml").model


def test_topology_refuses_an_unknown_routing_policy(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("name: x\nmodel: m\naggregated: [{port: 1}]\nproxy: {prefill_routing: random}\n")
    with pytest.raises(TopologyError, match="proxy.prefill_routing: Input should be 'round-robin', 'session' or "
                                            "'prefix-aware'"):
        load_topology(path)
