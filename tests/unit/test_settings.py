"""turnscope.conductor.settings: env vars, config files, precedence, error messages, the saved configuration."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from pydantic import SecretStr

from turnscope.conductor.settings import (
    SettingsError,
    TurnscopeSettings,
    _env_name,
    _leaf_paths,
    using_config_file,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No TURNSCOPE_* variable of the calling shell (or CI) leaks into these tests."""
    for k in list(os.environ):
        if k.upper().startswith("TURNSCOPE_"):
            monkeypatch.delenv(k)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_defaults_are_vllms_and_the_embedded_layouts() -> None:
    s = TurnscopeSettings.load()
    # vLLM's NixlConnector defaults (docs/features/nixl_connector_usage.md; docs/design.md).
    assert (s.connector.kv_recompute_threshold, s.connector.decoder_kv_blocks_ttl, s.connector.kv_lease_duration,
            s.connector.backends) == (64, 480, 30, ["UCX"])
    assert s.connector.kv_load_failure_policy == "recompute"
    # data/topologies/embedded-cpu.yaml: P 8100 (D 8101, aggregated 8102), side channels 5600/5601, proxy 8200.
    assert (s.ports.worker_base, s.ports.side_channel_base, s.ports.proxy) == (8100, 5600, 8200)
    assert (s.turn_timeout_s, s.prefill_timeout_s, s.handle_ttl_margin_s) == (120.0, 30.0, 30.0)
    assert s.config_file is None
    assert set(s.sources().values()) == {"default"}


def test_defaults_agree_with_the_serving_side() -> None:
    from core.connector import Connector
    from serving.proxy import ProxyConfig
    from serving.topology import ProxySettings

    s = TurnscopeSettings.load()
    assert isinstance(s.connector, Connector)
    assert type(s.topology_connector()) is Connector and s.topology_connector() == Connector()
    for proxy in (ProxyConfig(mode="pd-bidir"), ProxySettings()):
        assert (s.prefill_timeout_s, s.decode_timeout_s, s.handle_ttl_margin_s) == \
            (proxy.prefill_timeout_s, proxy.decode_timeout_s, proxy.handle_ttl_margin_s)
    assert s.connector.decoder_kv_blocks_ttl == ProxyConfig(mode="pd").decoder_kv_blocks_ttl_s
    assert s.ports.proxy == ProxySettings().port
    # every mode, baselines included, routes by session unless told otherwise (docs/configuration.md)
    for proxy in (ProxyConfig(mode="pd"), ProxySettings()):
        assert (s.prefill_routing, s.decode_routing) == (proxy.prefill_routing, proxy.decode_routing) == \
            ("session", "session")


def test_routing_from_env_and_bad_policy_named(monkeypatch) -> None:
    monkeypatch.setenv("TURNSCOPE_PREFILL_ROUTING", "round-robin")
    s = TurnscopeSettings.load()
    assert (s.prefill_routing, s.decode_routing) == ("round-robin", "session")
    assert s.effective()["prefill_routing"] == "round-robin"
    assert TurnscopeSettings.load(prefill_routing="prefix-aware").prefill_routing == "prefix-aware"  # CLI wins
    monkeypatch.setenv("TURNSCOPE_DECODE_ROUTING", "random")
    with pytest.raises(SettingsError, match=r"decode_routing: Input should be 'round-robin', 'session' or "
                                            r"'prefix-aware'; got 'random' \(from env TURNSCOPE_DECODE_ROUTING\)"):
        TurnscopeSettings.load()


def test_env_overrides(monkeypatch) -> None:
    monkeypatch.setenv("TURNSCOPE_STORE", "/srv/turnscope")
    monkeypatch.setenv("TURNSCOPE_PORTS__PROXY", "9200")
    monkeypatch.setenv("turnscope_connector__decoder_kv_blocks_ttl", "300")  # names are case-insensitive
    monkeypatch.setenv("TURNSCOPE_CONNECTOR__BACKENDS", "LIBFABRIC, UCX")
    monkeypatch.setenv("TURNSCOPE_TURN_TIMEOUT_S", "45.5")
    monkeypatch.setenv("TURNSCOPE_TEST_DECODER_TTL", "60")  # not a setting: ignored
    s = TurnscopeSettings.load()
    assert s.store == Path("/srv/turnscope")
    assert s.ports.proxy == 9200 and s.ports.worker_base == 8100
    assert s.connector.decoder_kv_blocks_ttl == 300 and s.connector.kv_lease_duration == 30
    assert s.connector.backends == ["LIBFABRIC", "UCX"]
    assert s.turn_timeout_s == 45.5
    assert s.sources()["ports.proxy"] == "env TURNSCOPE_PORTS__PROXY"
    assert s.sources()["ports.worker_base"] == "default"
    monkeypatch.setenv("TURNSCOPE_CONNECTOR__BACKENDS", '["GDS"]')  # JSON works too
    assert TurnscopeSettings.load().connector.backends == ["GDS"]


TOML = """\
# operator config
store = "runs-data"          # relative to this file
turn_timeout_s = 300

[ports]
proxy = 9300

[connector]
backends = [
    "LIBFABRIC",
]
decoder_kv_blocks_ttl = 600
kv_lease_duration = 40
"""


def test_file_then_env_then_arguments(tmp_path: Path, monkeypatch) -> None:
    f = write(tmp_path / "turnscope.toml", TOML)
    s = TurnscopeSettings.load(f)
    assert s.store == tmp_path / "runs-data"
    assert (s.turn_timeout_s, s.ports.proxy, s.connector.decoder_kv_blocks_ttl, s.connector.backends) == \
        (300.0, 9300, 600, ["LIBFABRIC"])
    assert s.config_file == f
    # env beats the file, field by field; the file still sets what env does not.
    monkeypatch.setenv("TURNSCOPE_CONNECTOR__DECODER_KV_BLOCKS_TTL", "200")
    s = TurnscopeSettings.load(f)
    assert (s.connector.decoder_kv_blocks_ttl, s.connector.kv_lease_duration, s.ports.proxy) == (200, 40, 9300)
    src = s.sources()
    assert src["connector.decoder_kv_blocks_ttl"] == "env TURNSCOPE_CONNECTOR__DECODER_KV_BLOCKS_TTL"
    assert src["connector.kv_lease_duration"] == f"{f}:13"   # line 13 of TOML above
    assert src["connector.backends"] == f"{f}:9"
    assert src["ports.proxy"] == f"{f}:6"
    assert src["ports.worker_base"] == "default"
    # arguments beat both.
    s = TurnscopeSettings.load(f, turn_timeout_s=10, ports={"proxy": 9400}, store=None)
    assert (s.turn_timeout_s, s.ports.proxy, s.connector.decoder_kv_blocks_ttl) == (10.0, 9400, 200)
    assert s.sources()["turn_timeout_s"] == "argument"
    assert s.store == tmp_path / "runs-data"  # None: not given, the file's value stands


def test_config_file_from_env_and_yaml(tmp_path: Path, monkeypatch) -> None:
    y = write(tmp_path / "t.yaml", "ports:\n  proxy: 9500\nconnector:\n  backends: [UCX, LIBFABRIC]\n")
    monkeypatch.setenv("TURNSCOPE_CONFIG", str(y))
    s = TurnscopeSettings()
    assert s.ports.proxy == 9500 and s.connector.backends == ["UCX", "LIBFABRIC"]
    assert s.sources()["ports.proxy"] == f"{y}:2"
    # An explicit file wins over TURNSCOPE_CONFIG.
    t = write(tmp_path / "t.toml", "[ports]\nproxy = 9600\n")
    assert TurnscopeSettings.load(t).ports.proxy == 9600
    with using_config_file(t):
        assert TurnscopeSettings().ports.proxy == 9600
    assert TurnscopeSettings().ports.proxy == 9500
    assert write(tmp_path / "empty.yaml", "").exists() and TurnscopeSettings.load(tmp_path / "empty.yaml").ports.proxy == 8200


def test_bad_env_value_names_field_and_variable(monkeypatch) -> None:
    monkeypatch.setenv("TURNSCOPE_CONNECTOR__KV_RECOMPUTE_THRESHOLD", "-5")
    with pytest.raises(SettingsError) as exc:
        TurnscopeSettings.load()
    msg = str(exc.value)
    assert "connector.kv_recompute_threshold" in msg and "greater than or equal to 0" in msg
    assert "env TURNSCOPE_CONNECTOR__KV_RECOMPUTE_THRESHOLD" in msg and "'-5'" in msg
    monkeypatch.delenv("TURNSCOPE_CONNECTOR__KV_RECOMPUTE_THRESHOLD")
    monkeypatch.setenv("TURNSCOPE_PORTS", "{not json")
    with pytest.raises(SettingsError, match=r'field "ports".*env TURNSCOPE_PORTS'):
        TurnscopeSettings.load()


def test_bad_file_values_name_field_file_and_line(tmp_path: Path) -> None:
    f = write(tmp_path / "bad.toml", "store = 'x'\n\n[connector]\nkv_load_failure_policy = 'retry'\nbackends = ['ucx']\n"
                                     "[ports]\nproxy = 8101\ncolour = 'blue'\n")
    with pytest.raises(SettingsError) as exc:
        TurnscopeSettings.load(f)
    msg = str(exc.value)
    assert f"connector.kv_load_failure_policy: Input should be 'recompute' or 'fail'; got 'retry' (from {f} line 4)" in msg
    assert "connector.backends" in msg and "not a NIXL backend name" in msg and f"{f} line 5" in msg
    assert "ports.colour: Extra inputs are not permitted" in msg and f"{f} line 8" in msg
    # 8101 is the decode worker's port (worker_base + 1): the model-level check names the section.
    f2 = write(tmp_path / "clash.yaml", "ports:\n  proxy: 8101\n")
    with pytest.raises(SettingsError, match=r"ports: Value error, port 8101 of proxy is also used by worker_base"):
        TurnscopeSettings.load(f2)
    f3 = write(tmp_path / "y.yml", "turn_timeout_s: 30\nprefill_timeout_s: soon\n")
    with pytest.raises(SettingsError, match=rf"prefill_timeout_s: .*valid number.*'soon' \(from {f3} line 2\)"):
        TurnscopeSettings.load(f3)


def test_unusable_files(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot read"):
        TurnscopeSettings.load(tmp_path / "missing.toml")
    with pytest.raises(SettingsError, match=r"not valid TOML.*line 2"):
        TurnscopeSettings.load(write(tmp_path / "broken.toml", "store = 'a'\nports = ]\n"))
    with pytest.raises(SettingsError, match=r"line 2, column \d+: not valid YAML"):
        TurnscopeSettings.load(write(tmp_path / "broken.yaml", "a: 1\n b: [\n"))
    with pytest.raises(SettingsError, match="unknown config file type '.ini'"):
        TurnscopeSettings.load(write(tmp_path / "c.ini", "[x]\n"))
    with pytest.raises(SettingsError, match="expected a mapping"):
        TurnscopeSettings.load(write(tmp_path / "list.yaml", "- 1\n"))


def test_margin_must_leave_a_ttl() -> None:
    with pytest.raises(SettingsError, match=r"handle_ttl_margin_s \(480.0 s\) must be below.*decoder_kv_blocks_ttl \(480 s\)"):
        TurnscopeSettings.load(handle_ttl_margin_s=480)
    assert TurnscopeSettings.load(handle_ttl_margin_s=479).handle_ttl_margin_s == 479


def test_effective_is_json_and_redacts_secrets(tmp_path: Path) -> None:
    s = TurnscopeSettings.load(store=tmp_path)
    eff = s.effective()
    assert json.loads(json.dumps(eff)) == eff
    assert eff["store"] == str(tmp_path)
    assert eff["connector"] == {"kv_recompute_threshold": 64, "decoder_kv_blocks_ttl": 480, "kv_lease_duration": 30,
                                "backends": ["UCX"], "kv_load_failure_policy": "recompute", "kv_buffer_device": None}
    # The keys the store's run_config view reads (data/schema.sql): $.connector.decoder_kv_blocks_ttl,
    # $.handle_ttl_margin_s, $.kv_bytes_per_token.
    assert (eff["connector"]["decoder_kv_blocks_ttl"], eff["handle_ttl_margin_s"], eff["kv_bytes_per_token"]) == \
        (480, 30.0, None)

    class WithSecrets(TurnscopeSettings):
        api_key: str = "sk-live-123"
        hf_token: SecretStr = SecretStr("hf_abc")
        db_password: str | None = None
        max_tokens: int = 64          # a count of tokens, not a token
        keyframe_s: float = 1.0       # "keyframe" is not the word "key"

    eff = WithSecrets.load().effective()
    assert (eff["api_key"], eff["hf_token"], eff["db_password"]) == ("***", "***", None)
    assert (eff["max_tokens"], eff["keyframe_s"]) == (64, 1.0)
    assert "sk-live-123" not in json.dumps(eff) and "hf_abc" not in json.dumps(eff)


def test_topology_connector_bridge(monkeypatch) -> None:
    monkeypatch.setenv("TURNSCOPE_CONNECTOR__BACKENDS", "LIBFABRIC")
    monkeypatch.setenv("TURNSCOPE_CONNECTOR__KV_BUFFER_DEVICE", "cuda")
    c = TurnscopeSettings.load().topology_connector()
    assert c.model_dump() == {"kv_recompute_threshold": 64, "decoder_kv_blocks_ttl": 480,
                                     "kv_lease_duration": 30, "backends": ["LIBFABRIC"],
                                     "kv_load_failure_policy": "recompute", "kv_buffer_device": "cuda"}


# ------------------------------------------------------------------------------ docs/configuration.md

CONFIG_DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _doc_table() -> dict[str, tuple[str, str]]:
    """setting -> (env var, default text) from the doc's settings table."""
    rows = re.findall(r"^\| `([\w.]+)` \| `(TURNSCOPE_\w+)` \| ([^|]+) \|", CONFIG_DOC.read_text(), flags=re.MULTILINE)
    return {name: (env, default.strip()) for name, env, default in rows}


def test_configuration_doc_lists_every_setting_with_its_env_var_and_default() -> None:
    s = TurnscopeSettings.load()
    doc = _doc_table()
    leaves = {".".join(loc): loc for loc in _leaf_paths(s)}
    assert set(doc) == set(leaves)
    for name, (env, default) in doc.items():
        assert env == _env_name(leaves[name])
        value = s
        for part in leaves[name]:
            value = getattr(value, part)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            assert float(default) == value, name
        elif isinstance(value, str):
            assert default == f"`{value}`", name


def test_configuration_doc_examples_load(tmp_path: Path) -> None:
    text = CONFIG_DOC.read_text()
    toml_text = re.search(r"^```toml\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE).group(1)
    yaml_text = re.search(r"^```yaml\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE).group(1)
    a = TurnscopeSettings.load(write(tmp_path / "turnscope.toml", toml_text))
    b = TurnscopeSettings.load(write(tmp_path / "turnscope.yaml", yaml_text))
    assert a.effective() == b.effective()
    assert (a.store, a.ports.proxy, a.connector.backends, a.connector.kv_buffer_device, a.kv_bytes_per_token) == \
        (Path("/srv/turnscope/data"), 9200, ["LIBFABRIC"], "cuda", 262144)
