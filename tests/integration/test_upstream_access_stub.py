"""Reaching deployments as teams run them, through the real proxy and stub workers: per-role API keys
on every leg, the proxy's own key, https upstreams verified against a CA bundle, and a decode worker
without streamed handles refused in words. (Real ``vllm serve --api-key`` workers:
tests/integration/test_api_keys_vllm.py.)"""

from __future__ import annotations

import subprocess

import httpx
import pytest
from fastapi.responses import JSONResponse
from prometheus_client.parser import text_string_to_metric_families

from serving.api_keys import CredentialError, SecretRef
from serving.handle_check import StockDecodeError, check_streamed_handles
from serving.proxy import ProxyConfig, SessionProxy, Worker
from serving.topology import load_topology
from serving.upstream_tls import UpstreamTLS
from serving.workers import (
    WorkerProcess,
    WorkerSpec,
    check_credentials,
    mode_workers,
    wait_http,
    worker_command,
)
from tests.integration.pd_stub import decode_app, prefill_app
from tests.integration.test_proxy_stub import stream
from tests.integration.vllm_stack import AppThread, ProxyThread

P_KEY, D_KEY, PROXY_KEY = "p-secret-4f1c", "d-secret-9a2e", "proxy-secret-77d0"


def guarded(app, key: str):
    """``app`` answering 401 to any request without ``Authorization: Bearer key`` (vLLM guards only
    /v1: ``vllm/entrypoints/serve/middleware/authenticate.py``; this stub guards every path but
    /health, as an ingress may), recording every Authorization header it saw."""
    app.state.auth = []

    @app.middleware("http")
    async def check(request, call_next):
        if request.url.path != "/health":
            app.state.auth.append((request.url.path, request.headers.get("authorization")))
            if request.headers.get("authorization") != f"Bearer {key}":
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    return app


def config(p, d, **kw) -> ProxyConfig:
    return ProxyConfig(mode="pd-bidir", prefill=[Worker(name="prefill-0", url=p.url, api_key=SecretRef(env="TS_P_KEY"))],
                       decode=[Worker(name="decode-0", url=d.url, api_key=SecretRef(env="TS_D_KEY"))],
                       kv_bytes_per_token=4096, block_size=4, kv_recompute_threshold=2, **kw)


def unauthorized_total(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text)
               if f.name == "turnscope_proxy_unauthorized_requests" for s in f.samples if s.name.endswith("_total"))


def test_every_leg_carries_its_roles_key_and_the_proxy_demands_its_own(monkeypatch, tmp_path):
    monkeypatch.setenv("TS_P_KEY", P_KEY)
    monkeypatch.setenv("TS_D_KEY", D_KEY)
    key_file = tmp_path / "proxy-key"
    key_file.write_text(PROXY_KEY + "\n")  # a file's surrounding whitespace is not part of the key
    with AppThread(guarded(prefill_app(), P_KEY)) as p, AppThread(guarded(decode_app(gen=4), D_KEY)) as d, \
            ProxyThread(config(p, d, api_key=SecretRef(file=str(key_file)), decode_probe_interval_s=0.05)) as proxy:
        assert httpx.get(proxy.url + "/health").status_code == 200     # open, as vLLM's is
        assert unauthorized_total(proxy.url) == 0                      # /metrics open too
        body = {"model": "m", "prompt": list(range(10)), "max_tokens": 4}
        assert httpx.post(proxy.url + "/v1/completions", json=body).status_code == 401
        assert httpx.post(proxy.url + "/v1/completions", json=body,
                          headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.post(proxy.url + "/tokenize", json={"prompt": "x"}).status_code == 401
        assert unauthorized_total(proxy.url) == 3
        assert not p.app.state.bodies and not d.app.state.bodies       # no worker was called for them
        auth = {"Authorization": f"Bearer {PROXY_KEY}"}
        r1, _, _, _ = stream(proxy.url, list(range(10)), "s1", headers=auth)
        r2, _, facts2, _ = stream(proxy.url, list(range(10)) + [100, 101, 102, 103, 50, 51], "s1", headers=auth)
        assert httpx.get(proxy.url + "/v1/models", headers=auth).status_code in (200, 404)
    assert r1.status_code == r2.status_code == 200
    assert r2.headers["x-turnscope-reuse"] == "hit" and facts2["reused_tokens"] > 0
    # every request the stubs saw carried its own role's key, the decode probe's /metrics included
    assert {h for _, h in p.app.state.auth} == {f"Bearer {P_KEY}"}
    assert {h for _, h in d.app.state.auth} == {f"Bearer {D_KEY}"}
    assert {path for path, _ in d.app.state.auth} >= {"/v1/completions", "/metrics"}


def test_a_key_that_cannot_be_read_names_whose_and_where(monkeypatch, tmp_path):
    monkeypatch.delenv("TS_P_KEY", raising=False)
    monkeypatch.setenv("TS_D_KEY", D_KEY)
    p, d = Worker(name="x", url="http://127.0.0.1:1"), Worker(name="y", url="http://127.0.0.1:2")
    with pytest.raises(CredentialError, match="worker prefill-0's api_key: environment variable TS_P_KEY is unset"):
        SessionProxy(config(p, d))
    monkeypatch.setenv("TS_P_KEY", P_KEY)
    missing = tmp_path / "nope"
    with pytest.raises(CredentialError, match=f"the proxy's api_key: cannot read file {missing}"):
        SessionProxy(config(p, d, api_key=SecretRef(file=str(missing))))
    with pytest.raises(ValueError, match="exactly one of env"):
        SecretRef(env="A", file="b")


def test_a_refused_key_names_the_role_and_its_source(monkeypatch):
    monkeypatch.setenv("TS_P_KEY", "not-it")
    with AppThread(guarded(prefill_app(), P_KEY)) as p:
        spec = WorkerSpec(name="prefill-0", role="prefill", host="127.0.0.1", port=p.port, model="m",
                          launch=False, api_key=SecretRef(env="TS_P_KEY"))
        with pytest.raises(CredentialError, match=r"prefill worker prefill-0 at http://127\.0\.0\.1:\d+ answered "
                                                  r"HTTP 401: its key, read from environment variable TS_P_KEY "
                                                  r"\(roles\.prefill\.api_key\), was refused"):
            check_credentials(spec)
        spec.api_key = None
        with pytest.raises(CredentialError, match="it demands an API key and roles.prefill.api_key gives none"):
            check_credentials(spec)
        monkeypatch.setenv("TS_P_KEY", P_KEY)
        spec.api_key = SecretRef(env="TS_P_KEY")
        check_credentials(spec)  # the right key passes


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 made here with Debian's openssl: (certfile, keyfile)."""
    d = tmp_path_factory.mktemp("tls")
    cert, key = str(d / "cert.pem"), str(d / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


def tls_config(p, d, tls: UpstreamTLS) -> ProxyConfig:
    return ProxyConfig(mode="pd-bidir", prefill=[Worker(name="prefill-0", url=p.url)],
                       decode=[Worker(name="decode-0", url=d.url)], kv_bytes_per_token=4096, block_size=4,
                       kv_recompute_threshold=2, decode_probe_interval_s=0, tls=tls)


def test_https_upstreams_are_verified_against_the_ca_bundle(certificate):
    cert, _ = certificate
    with AppThread(prefill_app(), tls=certificate) as p, AppThread(decode_app(gen=4), tls=certificate) as d:
        assert p.url.startswith("https://")
        with ProxyThread(tls_config(p, d, UpstreamTLS(ca_bundle=cert))) as proxy:
            r, _, facts, _ = stream(proxy.url, list(range(10)), "s1")
        assert r.status_code == 200 and facts["handle_tokens"] == 13  # 10 prompt + 4 generated - 1 (the stub's)
        # the system's authorities do not know this certificate: refused, the turn failed, D never called
        with ProxyThread(tls_config(p, d, UpstreamTLS())) as proxy:
            refused = httpx.post(proxy.url + "/v1/completions", json={"model": "m", "prompt": [1, 2, 3]})
        assert refused.status_code == 502 and "CERTIFICATE_VERIFY_FAILED" in refused.text
        assert refused.json()["error"]["type"] == "prefill_failed" and len(d.app.state.bodies) == 1
        with ProxyThread(tls_config(p, d, UpstreamTLS(verify=False))) as proxy:  # only when told
            assert stream(proxy.url, [1, 2, 3, 4, 5], "s2")[0].status_code == 200
        # the start-up checks say what to change
        with pytest.raises(ValueError, match="TLS certificate refused .* tls.ca_bundle"):
            wait_http(p.url + "/health", 5, verify=UpstreamTLS().httpx_verify())
        assert wait_http(p.url + "/health", 5, verify=UpstreamTLS(ca_bundle=cert).httpx_verify()) >= 0
        spec = WorkerSpec(name="prefill-0", role="prefill", host="127.0.0.1", port=p.port, model="m", launch=False,
                          base_url=p.url)
        with pytest.raises(ValueError, match="worker prefill-0: https://.* TLS certificate refused"):
            WorkerProcess(spec, "unused.log").healthy_now()
        spec.tls = UpstreamTLS(ca_bundle=cert)
        assert WorkerProcess(spec, "unused.log").healthy_now()


def test_a_topology_names_https_workers_and_its_ca_bundle(tmp_path, certificate):
    cert, _ = certificate
    path = tmp_path / "t.yaml"
    path.write_text(f"""name: behind-ingress
model: /models/m
launch: false
attached_mode: pd
tls: {{ca_bundle: {cert}}}
prefill: [{{host: 10.0.0.1, port: 8100, side_channel_port: 5600, url: "https://gw.example.com/p0/"}}]
decode: [{{host: 10.0.0.2, port: 8200, side_channel_port: 5601}}]
roles: {{decode: {{api_key: {{env: D_KEY}}, entry: vllm}}}}
""")
    topo = load_topology(path)
    p, d = mode_workers("pd", topo)
    assert p.url == "https://gw.example.com/p0" and d.url == "http://10.0.0.2:8200"
    assert d.api_key == SecretRef(env="D_KEY") and p.api_key is None and p.tls.ca_bundle == cert
    assert worker_command(d)[0][2] == "vllm.entrypoints.launchers.api_server.entry"
    assert worker_command(p)[0][2] == "serving.vllm_worker"
    bad = path.read_text().replace("url: \"https://gw.example.com/p0/\"", "url: \"ftp://gw\"")
    path.write_text(bad)
    with pytest.raises(ValueError, match=r"prefill\.0\.url"):
        load_topology(path)


def test_a_decode_worker_without_streamed_handles_is_named_and_refused():
    refused = r"decode worker decode-0 \(http://127.0.0.1:\d+\) returned no KV handle .*vLLM PR 40186.* roles\.decode\.entry"
    with AppThread(prefill_app()) as p, AppThread(decode_app(gen=4, handle=False)) as d, \
            ProxyThread(tls_config(p, d, UpstreamTLS())) as proxy, pytest.raises(StockDecodeError, match=refused):
        check_streamed_handles(proxy.url, "m", {"decode-0": d.url})
    with AppThread(prefill_app()) as p, AppThread(decode_app(gen=4)) as d, \
            ProxyThread(tls_config(p, d, UpstreamTLS())) as proxy:
        assert check_streamed_handles(proxy.url, "m", {"decode-0": d.url}) == {"decode-0": True}
        # one check turn, then its release turn: streamed, asking for 64 tokens, left after the first
        assert [b["max_tokens"] for b in d.app.state.bodies] == [2, 64]
        assert p.app.state.bodies[1]["kv_transfer_params"]["remote_engine_id"] == "D"  # P pulled the handle


def two_decode_config(p, d0, d1, routing: str) -> ProxyConfig:
    return ProxyConfig(mode="pd-bidir", prefill=[Worker(name="prefill-0", url=p.url)],
                       decode=[Worker(name="decode-0", url=d0.url), Worker(name="decode-1", url=d1.url)],
                       kv_bytes_per_token=4096, block_size=4, kv_recompute_threshold=2, decode_probe_interval_s=0,
                       decode_routing=routing)


@pytest.mark.parametrize("routing", ["round-robin", "session", "prefix-aware"])
def test_every_decode_worker_is_checked_by_name_whatever_the_routing(routing):
    """decode-1 returns no handle. Round-robin sends each check turn's release turn to the other D,
    so routed check turns would only ever reach decode-0 and decode-1 would pass unchecked: each D
    is named instead (the proxy's DECODE_WORKER_HEADER), and decode-1 is refused by name."""
    refused = r"decode worker decode-1 \(http://127.0.0.1:\d+\) returned no KV handle"
    with AppThread(prefill_app()) as p, AppThread(decode_app(gen=4)) as d0, \
            AppThread(decode_app(gen=4, handle=False)) as d1, \
            ProxyThread(two_decode_config(p, d0, d1, routing)) as proxy:
        with pytest.raises(StockDecodeError, match=refused) as err:
            check_streamed_handles(proxy.url, "m", {"decode-0": d0.url, "decode-1": d1.url})
        assert "decode-0" not in str(err.value)
        # each D got exactly its own check turn (2 tokens) and release turn (64), nothing of the other's
        assert [b["max_tokens"] for b in d0.app.state.bodies] == [2, 64]
        assert [b["max_tokens"] for b in d1.app.state.bodies] == [2, 64]
    with AppThread(prefill_app()) as p, AppThread(decode_app(gen=4)) as d0, AppThread(decode_app(gen=4)) as d1, \
            ProxyThread(two_decode_config(p, d0, d1, routing)) as proxy:
        assert check_streamed_handles(proxy.url, "m", {"decode-0": d0.url, "decode-1": d1.url}) == \
            {"decode-0": True, "decode-1": True}


def test_a_decode_worker_named_that_the_proxy_lacks_is_refused():
    """The header names a D the proxy does not have: 400 naming the header and the Ds it has, no
    worker called; a name the proxy has is served by that D whatever the routing."""
    with AppThread(prefill_app()) as p, AppThread(decode_app(gen=4)) as d0, AppThread(decode_app(gen=4)) as d1, \
            ProxyThread(two_decode_config(p, d0, d1, "session")) as proxy:
        body = {"model": "m", "prompt": list(range(10)), "max_tokens": 2, "conversation_id": "s"}
        r = httpx.post(proxy.url + "/v1/completions", json=body, headers={"x-turnscope-decode-worker": "decode-7"})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "x-turnscope-decode-worker" and "decode-0, decode-1" in error["message"]
        assert not p.app.state.bodies and not d0.app.state.bodies and not d1.app.state.bodies
        for name in ("decode-1", "decode-0", "decode-1"):  # the stub D streams
            with httpx.stream("POST", proxy.url + "/v1/completions", json=body | {"stream": True},
                              headers={"x-turnscope-decode-worker": name}) as r:
                r.read()
                assert r.status_code == 200 and r.headers["x-turnscope-decode-engine"] == name
        assert len(d1.app.state.bodies) == 2 and len(d0.app.state.bodies) == 1
