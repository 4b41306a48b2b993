"""serving.prometheus_config: the generated scrape configuration and deploy/prometheus.yml."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from serving.prometheus_config import embedded_targets, render_prometheus_config

REPO = Path(__file__).resolve().parents[2]
DEPLOYED = REPO / "deploy" / "prometheus.yml"


def _targets_by_label(doc: dict) -> dict[str, tuple[str, str, str]]:
    """host:port -> (job, metrics_path, role), read back from a parsed prometheus.yml."""
    out = {}
    for sc in doc["scrape_configs"]:
        for group in sc["static_configs"]:
            for addr in group["targets"]:
                assert addr not in out
                out[addr] = (sc["job_name"], sc.get("metrics_path", "/metrics"), group["labels"]["role"])
    return out


def test_xpyd_topology_round_trips_through_yaml() -> None:
    # 2P2D on two hosts plus the proxy: every worker and the proxy is scraped once, with its role.
    targets = [
        ("turnscope-proxy", "http://127.0.0.1:8200", "proxy"),
        ("vllm", "http://10.0.0.1:8100", "prefill"),
        ("vllm", "http://10.0.0.1:8101", "prefill"),
        ("vllm", "http://10.0.0.2:8200", "decode"),
        ("vllm", "http://10.0.0.2:8201/", "decode"),
    ]
    doc = yaml.safe_load(render_prometheus_config(targets, scrape_interval_s=2))
    assert doc["global"] == {"scrape_interval": "2s", "evaluation_interval": "2s"}
    assert [sc["job_name"] for sc in doc["scrape_configs"]] == ["turnscope-proxy", "vllm"]
    assert _targets_by_label(doc) == {
        "127.0.0.1:8200": ("turnscope-proxy", "/metrics", "proxy"),
        "10.0.0.1:8100": ("vllm", "/metrics", "prefill"),
        "10.0.0.1:8101": ("vllm", "/metrics", "prefill"),
        "10.0.0.2:8200": ("vllm", "/metrics", "decode"),
        "10.0.0.2:8201": ("vllm", "/metrics", "decode"),
    }
    # The only target label is the role: nothing per session or per request.
    labels = {k for sc in doc["scrape_configs"] for g in sc["static_configs"] for k in g["labels"]}
    assert labels == {"role"}


def test_path_prefix_scheme_ipv6_and_durations() -> None:
    doc = yaml.safe_load(render_prometheus_config(
        [("gw", "https://gw.example:9443/turnscope/", "proxy"), ("v6", "http://[::1]:8100", "decode")],
        scrape_interval_s=1.5, scrape_timeout_s=1))
    gw, v6 = doc["scrape_configs"]
    assert gw == {"job_name": "gw", "scheme": "https", "metrics_path": "/turnscope/metrics",
                  "static_configs": [{"targets": ["gw.example:9443"], "labels": {"role": "proxy"}}]}
    assert v6["static_configs"][0]["targets"] == ["[::1]:8100"]
    assert doc["global"] == {"scrape_interval": "1500ms", "evaluation_interval": "1500ms", "scrape_timeout": "1s"}
    # A URL without a port gets the scheme's default port (RFC 9110: 80 for http, 443 for https).
    doc = yaml.safe_load(render_prometheus_config([("a", "http://h", "proxy"), ("b", "https://h", "decode")]))
    assert [sc["static_configs"][0]["targets"] for sc in doc["scrape_configs"]] == [["h:80"], ["h:443"]]


@pytest.mark.parametrize("targets, fragment", [
    ([], "no targets"),
    ([("vllm", "http://127.0.0.1:8100", "router")], "role must be one of"),
    ([("vllm", "127.0.0.1:8100", "prefill")], "url must be http(s)"),
    ([("vllm", "http://127.0.0.1:8100?x=1", "prefill")], "query or fragment"),
    ([("bad job!", "http://127.0.0.1:8100", "prefill")], "job must be"),
    ([("a", "http://127.0.0.1:8100", "prefill"), ("b", "http://127.0.0.1:8100", "decode")], "already scraped"),
    ([("a", "http://h1:1", "prefill"), ("a", "https://h2:1", "decode")], "share scheme and path"),
])
def test_bad_targets_are_refused_with_the_target_named(targets, fragment) -> None:
    with pytest.raises(ValueError, match="targets|no targets") as exc:
        render_prometheus_config(targets)
    assert fragment in str(exc.value)


def test_timeout_longer_than_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds scrape_interval_s"):
        render_prometheus_config(embedded_targets(), scrape_interval_s=5, scrape_timeout_s=10)


def test_deployed_file_is_the_generated_embedded_config() -> None:
    assert DEPLOYED.read_text() == render_prometheus_config(embedded_targets())
    # The embedded topology's ports (data/topologies/embedded-cpu.yaml): P 8100, D 8101,
    # aggregated 8102, proxy 8200.
    assert _targets_by_label(yaml.safe_load(DEPLOYED.read_text())) == {
        "127.0.0.1:8200": ("turnscope-proxy", "/metrics", "proxy"),
        "127.0.0.1:8100": ("vllm", "/metrics", "prefill"),
        "127.0.0.1:8101": ("vllm", "/metrics", "decode"),
        "127.0.0.1:8102": ("vllm", "/metrics", "aggregated"),
    }


def test_embedded_targets_match_the_embedded_topology_file() -> None:
    topo_path = REPO / "data" / "topologies" / "embedded-cpu.yaml"
    if not topo_path.exists():
        pytest.skip("data/topologies/embedded-cpu.yaml not present")
    topo = yaml.safe_load(topo_path.read_text())
    want = {(f"{w['host']}:{w['port']}", role) for role in ("prefill", "decode", "aggregated")
            for w in topo.get(role) or []}
    proxy = topo.get("proxy") or {}
    want.add((f"{proxy.get('host', '127.0.0.1')}:{proxy.get('port', 8200)}", "proxy"))
    got = {(url.split("//", 1)[1], role) for _, url, role in embedded_targets()}
    assert got == want


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_promtool_accepts_the_deployed_file() -> None:
    r = subprocess.run(["promtool", "check", "config", str(DEPLOYED)], capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
