"""turnscope's operator settings: one pydantic-settings model, from env vars and a config file.

What an operator sets (docs/configuration.md): where the store and the model are, the ports of the
embedded layout, the NixlConnector settings, the per-turn and per-leg timeouts, and the proxy's
routing policies for P and D. Sources, the
first that sets a field wins:

1. arguments given in code (``TurnscopeSettings.load(store=...)``, CLI options);
2. environment variables ``TURNSCOPE_<FIELD>``, nested fields with ``__``
   (``TURNSCOPE_CONNECTOR__DECODER_KV_BLOCKS_TTL=300``, ``TURNSCOPE_PORTS__PROXY=9200``); list
   fields take JSON or a comma-separated list (``TURNSCOPE_CONNECTOR__BACKENDS=UCX,LIBFABRIC``);
3. a config file, TOML (``.toml``) or YAML (``.yaml``/``.yml``), given as ``load(config_file=...)``
   or by ``TURNSCOPE_CONFIG``; relative ``store``/``model`` paths in it are relative to the file;
4. the defaults below (vLLM's connector defaults; the embedded topology's ports).

Example file (``turnscope.toml``)::

    store = "/srv/turnscope/data"
    model = "/models/Qwen3-32B"
    turn_timeout_s = 300

    [ports]
    proxy = 9200

    [connector]
    backends = ["LIBFABRIC"]
    decoder_kv_blocks_ttl = 480

Errors (:class:`SettingsError`, a ValueError) name each bad field and where its value came from:
the environment variable, or the file and line. :meth:`TurnscopeSettings.effective` is the
JSON-able configuration to save with every run (``runs_log.config``); fields that look like
secrets are redacted there.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings import SettingsError as _PydanticSettingsError

from core import resources, yaml_file
from core.connector import Connector
from core.contract import SESSION, RoutingPolicy
from core.redaction import REDACTED, redact
from serving.embedded_model import DEFAULT_MODEL_DIR

ENV_PREFIX = "TURNSCOPE_"
ENV_NESTED_DELIMITER = "__"
#: Names the config file when ``load()`` is not given one.
CONFIG_ENV = "TURNSCOPE_CONFIG"

_CONFIG_FILE: ContextVar[Path | None] = ContextVar("turnscope_config_file", default=None)


class SettingsError(ValueError):
    """Invalid turnscope settings; the message names each field and the source of its value."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _split_list(value: Any) -> Any:
    """A list from a JSON list string or a comma-separated string (env vars); others unchanged."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [part.strip() for part in text.split(",") if part.strip()]
    return value


class PortSettings(_Strict):
    """Ports of the embedded layout on one host (``serving.topology.embedded_topology``).

    The prefill worker listens on ``worker_base``, the decode worker on ``worker_base + 1``, the
    aggregated worker on ``worker_base + 2``; their NIXL side channels
    (``VLLM_NIXL_SIDE_CHANNEL_PORT``) on ``side_channel_base`` and ``side_channel_base + 1``; the
    proxy on ``proxy``. A topology file gives its own ports instead.
    """

    worker_base: int = Field(8100, gt=0, lt=65534)
    side_channel_base: int = Field(5600, gt=0, lt=65535)
    proxy: int = Field(8200, gt=0, lt=65536)

    @model_validator(mode="after")
    def _distinct(self) -> PortSettings:
        used: dict[int, str] = {}
        for name, ports in (("worker_base", range(self.worker_base, self.worker_base + 3)),
                            ("side_channel_base", range(self.side_channel_base, self.side_channel_base + 2)),
                            ("proxy", [self.proxy])):
            for p in ports:
                if p in used:
                    raise ValueError(f"port {p} of {name} is also used by {used[p]} (workers take worker_base..+2, "
                                     "side channels side_channel_base..+1)")
                used[p] = name
        return self


class ConnectorConfig(Connector):
    """NixlConnector settings: ``core.connector.Connector`` (the same fields, defaults and checks;
    an instance is one), plus two conveniences for operators.

    Defaults are vLLM's (docs/features/nixl_connector_usage.md; ``nixl/base_scheduler.py``,
    ``nixl/base_worker.py``): ``kv_recompute_threshold`` 64 tokens, ``decoder_kv_blocks_ttl``
    480 s, ``kv_lease_duration`` 30 s, ``backends`` ["UCX"] (["LIBFABRIC"] on EFA).
    ``kv_load_failure_policy`` is "recompute" (vLLM's own default is "fail",
    ``vllm/config/kv_transfer.py``). ``kv_buffer_device`` None lets the platform decide.
    Added here: ``backends`` also reads a comma-separated string (``TURNSCOPE_CONNECTOR__BACKENDS=
    UCX,LIBFABRIC``), and each backend must look like a NIXL backend name (upper case: UCX,
    LIBFABRIC, GDS, ...).
    """

    backends: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["UCX"], min_length=1)

    @field_validator("backends", mode="before")
    @classmethod
    def _split_backends(cls, v: Any) -> Any:
        return _split_list(v)

    @field_validator("backends")
    @classmethod
    def _backend_names(cls, v: list[str]) -> list[str]:
        for b in v:
            if not re.fullmatch(r"[A-Z][A-Z0-9_]*", b):
                raise ValueError(f"backend {b!r} is not a NIXL backend name (e.g. UCX, LIBFABRIC, GDS)")
        return v


class TurnscopeSettings(BaseSettings):
    """Everything an operator configures. Times in seconds, sizes in tokens or bytes.

    Build it with :meth:`load` (errors as :class:`SettingsError`) or directly
    (``TurnscopeSettings()``: environment and ``TURNSCOPE_CONFIG`` file, same errors).
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_NESTED_DELIMITER,
                                      extra="forbid", validate_default=True, case_sensitive=False)

    store: Path = Field(default_factory=resources.home,
                        description="store root: Parquet shards + turnscope.duckdb views")
    model: Path = Field(DEFAULT_MODEL_DIR, description="model directory the workers load (default: the embedded tiny model)")
    served_model_name: str = Field("turnscope-tiny", min_length=1)
    host: str = Field("127.0.0.1", min_length=1, description="address the proxy and embedded workers bind")
    ports: PortSettings = Field(default_factory=PortSettings)
    connector: ConnectorConfig = Field(default_factory=ConnectorConfig)
    turn_timeout_s: float = Field(120.0, gt=0, description="client: one turn's whole request, seconds")
    prefill_timeout_s: float = Field(30.0, gt=0, description="proxy: the prefill leg, seconds (then recompute)")
    decode_timeout_s: float = Field(300.0, gt=0, description="proxy: the decode leg, seconds")
    handle_ttl_margin_s: float = Field(30.0, ge=0, description="proxy TTL = decoder_kv_blocks_ttl minus this")
    kv_bytes_per_token: int | None = Field(None, gt=0, description="model KV bytes per token; None: unknown")
    prefill_routing: RoutingPolicy = Field(SESSION, description="proxy: how P is picked (serving.routing)")
    decode_routing: RoutingPolicy = Field(SESSION, description="proxy: how D is picked (serving.routing)")

    @field_validator("store", "model", mode="after")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        return v.expanduser()

    _init_keys: frozenset[str] = PrivateAttr(default_factory=frozenset)
    _config_file: Path | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _ttl_margin(self) -> TurnscopeSettings:
        if self.handle_ttl_margin_s >= self.connector.decoder_kv_blocks_ttl:
            raise ValueError(f"handle_ttl_margin_s ({self.handle_ttl_margin_s} s) must be below "
                             f"connector.decoder_kv_blocks_ttl ({self.connector.decoder_kv_blocks_ttl} s): "
                             "the proxy offers handles for the difference")
        return self

    def __init__(self, **values: Any):
        path = _config_path()
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise SettingsError(_describe(exc, values, path)) from None
        except _PydanticSettingsError as exc:  # an env var that does not decode (e.g. bad JSON)
            m = re.search(r'field "(\w+)"', str(exc))
            names = sorted(k for k in os.environ if m and k.upper().startswith(_env_name((m.group(1),))))
            where = f" (env {', '.join(names)})" if names else ""
            raise SettingsError(f"invalid turnscope settings: {exc}{where}") from None
        self._init_keys = frozenset(values)
        self._config_file = path

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Arguments, then ``TURNSCOPE_*`` env vars, then the config file (no .env, no secrets dir)."""
        return init_settings, env_settings, _ConfigFileSource(settings_cls)

    @classmethod
    def load(cls, config_file: str | os.PathLike | None = None, **overrides: Any) -> TurnscopeSettings:
        """Settings from ``overrides``, the environment and a config file.

        Args:
            config_file: a ``.toml``, ``.yaml`` or ``.yml`` file; default: ``$TURNSCOPE_CONFIG``
                if set, else none.
            overrides: field values that win over every other source (e.g. CLI options); nested
                models as dicts, merged field by field with the other sources
                (``connector={"decoder_kv_blocks_ttl": 300}`` keeps the file's ``backends``).
                An override whose value is None is ignored (an option that was not given).

        Raises:
            SettingsError: a value is invalid (each field named with its source), the file is
                missing, unreadable, not TOML/YAML, or not a mapping.
        """
        token = _CONFIG_FILE.set(Path(config_file) if config_file is not None else None)
        try:
            return cls(**{k: v for k, v in overrides.items() if v is not None})
        finally:
            _CONFIG_FILE.reset(token)

    @property
    def config_file(self) -> Path | None:
        """The config file these settings read, if any."""
        return self._config_file

    def effective(self) -> dict[str, Any]:
        """The effective configuration as a JSON-able dict (paths as strings, nested models as
        dicts), to be saved with every run (``runs_log.config``). Any ``SecretStr`` reads ``"***"``,
        and so does every string the store would redact (:func:`core.redaction.redact`: a
        secret-looking name such as ``api_key`` or ``hf_token``, credentials in URLs)."""
        return redact(_hide_secret_str(self.model_dump(mode="json"), self))

    def sources(self) -> dict[str, str]:
        """Where each leaf field's value came from: ``"argument"``, ``"env TURNSCOPE_..."``,
        ``"<file>:<line>"`` or ``"default"``; keys are dotted field paths (``connector.backends``)."""
        lines = _file_lines(self._config_file) if self._config_file else {}
        out = {}
        for loc in _leaf_paths(self):
            out[".".join(loc)] = _leaf_origin(loc, self._init_keys, lines, self._config_file)
        return out

    def topology_connector(self) -> Connector:
        """These connector settings as a plain ``core.connector.Connector`` (what topologies and
        ``serving.workers.WorkerSpec`` hold)."""
        return Connector.model_validate(self.connector.model_dump())


# ------------------------------------------------------------------------------ the config file


def _config_path() -> Path | None:
    explicit = _CONFIG_FILE.get()
    if explicit is not None:
        return explicit
    env = os.environ.get(CONFIG_ENV)
    return Path(env) if env else None


def _read_config(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsError(f"{path}: cannot read the turnscope config file: {exc}") from None
    suffix = path.suffix.lower()
    if suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"{path}: not valid TOML: {exc}") from None
    elif suffix in (".yaml", ".yml"):
        data = yaml_file.parse_mapping(text, path, "settings", SettingsError)
    else:
        raise SettingsError(f"{path}: unknown config file type {suffix!r}; use .toml, .yaml or .yml")
    if not isinstance(data, dict):
        raise SettingsError(f"{path}: expected a mapping of settings at the top level, got {type(data).__name__}")
    for key in ("store", "model"):  # relative paths in a file are relative to the file
        if isinstance(data.get(key), str) and not Path(data[key]).expanduser().is_absolute():
            data[key] = str((path.parent / data[key]).resolve())
    return data


class _ConfigFileSource(PydanticBaseSettingsSource):
    """The TOML/YAML config file named by ``load(config_file=...)`` or ``TURNSCOPE_CONFIG``."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ returns the whole mapping

    def __call__(self) -> dict[str, Any]:
        path = _config_path()
        return _read_config(path) if path is not None else {}


def _file_lines(path: Path) -> dict[tuple[str, ...], int]:
    """Dotted key path -> 1-based line where the file sets it (best effort; {} when unreadable)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return {}
    if path.suffix.lower() == ".toml":
        return _toml_lines(text)
    return yaml_file.key_lines(text)


def _outside_quotes(text: str) -> Iterator[tuple[int, str]]:
    """(index, char) of every character of ``text`` outside TOML strings."""
    quote = None
    escaped = False
    for i, ch in enumerate(text):
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\" and quote == '"':
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        else:
            yield i, ch


def _strip_comment(line: str) -> str:
    for i, ch in _outside_quotes(line):
        if ch == "#":
            return line[:i]
    return line


def _toml_key(text: str) -> tuple[str, ...]:
    cuts = [i for i, ch in _outside_quotes(text) if ch == "."]
    parts = [text[a + 1:b] for a, b in zip([-1, *cuts], [*cuts, len(text)], strict=True)]
    return tuple(p.strip().strip("\"'") for p in parts)


def _bracket_depth(text: str) -> int:
    return sum({"[": 1, "{": 1, "]": -1, "}": -1}.get(ch, 0) for _, ch in _outside_quotes(text))


def _toml_lines(text: str) -> dict[tuple[str, ...], int]:
    """Key path -> line of ``[table]`` headers and ``key = value`` lines. Values that span lines
    (arrays, inline tables) are attributed to the line of their key."""
    out: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    depth = 0
    for n, raw in enumerate(text.splitlines(), start=1):
        line = _strip_comment(raw).strip()
        if depth > 0:
            depth += _bracket_depth(line)
            continue
        if m := re.match(r"^\[\[?(.+?)\]\]?$", line):
            table = _toml_key(m.group(1))
            out.setdefault(table, n)
        elif m := re.match(r"^((?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*'))*)"
                           r"\s*=(.*)$", line):
            out[(*table, *_toml_key(m.group(1)))] = n
            depth = max(_bracket_depth(m.group(2)), 0)
    return out


# ------------------------------------------------------------------------------ errors and provenance


def _env_name(loc: tuple[str, ...]) -> str:
    return ENV_PREFIX + ENV_NESTED_DELIMITER.join(part.upper() for part in loc)


def _env_lookup(loc: tuple[str, ...]) -> tuple[str, str] | None:
    """The ``TURNSCOPE_*`` variable that sets ``loc`` or an ancestor of it (case-insensitive)."""
    env = {k.upper(): (k, v) for k, v in os.environ.items()}
    for n in range(len(loc), 0, -1):
        hit = env.get(_env_name(loc[:n]))
        if hit is not None:
            return hit
    return None


def _origins(loc: tuple[str, ...], init_keys: frozenset[str], lines: dict[tuple[str, ...], int],
             path: Path | None) -> list[str]:
    """Where the value at ``loc`` came from: ``argument``, ``env NAME``, ``<file>:<line>`` (each
    source that set ``loc``, an ancestor or a descendant of it, highest precedence first), or
    ``default``."""
    if loc and loc[0] in init_keys:
        return ["argument"]
    found: list[str] = []
    hit = _env_lookup(loc)
    if hit is not None:
        found.append(f"env {hit[0]}")
    else:
        below = _env_name(loc) + ENV_NESTED_DELIMITER
        found += sorted(f"env {k}" for k in os.environ if k.upper().startswith(below))
    if found:
        return found
    for n in range(len(loc), 0, -1):
        if loc[:n] in lines:
            return [f"{path}:{lines[loc[:n]]}"]
    below_lines = sorted(line for key, line in lines.items() if key[:len(loc)] == loc and len(key) > len(loc))
    return [f"{path}:{line}" for line in below_lines] or ["default"]


def _leaf_origin(loc: tuple[str, ...], init_keys: frozenset[str], lines: dict[tuple[str, ...], int],
                 path: Path | None) -> str:
    """The source that set the leaf field ``loc`` itself (a whole nested model given as an
    argument or as JSON in one env var counts only when it contains the leaf)."""
    if loc[0] in init_keys:
        return "argument"
    env = {k.upper(): (k, v) for k, v in os.environ.items()}
    for n in range(len(loc), 0, -1):
        hit = env.get(_env_name(loc[:n]))
        if hit is None:
            continue
        if n == len(loc):
            return f"env {hit[0]}"
        try:
            value: Any = json.loads(hit[1])
            for part in loc[n:]:
                value = {str(k).lower(): v for k, v in value.items()}[part]
        except (ValueError, AttributeError, KeyError):
            continue
        return f"env {hit[0]}"
    if loc in lines:
        return f"{path}:{lines[loc]}"
    return "default"


def _source_text(origin: str, path: Path | None) -> str:
    if origin == "argument":
        return "given as an argument"
    if origin == "default":
        return "the default"
    if origin.startswith("env "):
        return "from " + origin
    return f"from {path} line {origin.rsplit(':', 1)[1]}"


def _describe(exc: ValidationError, init_values: Mapping[str, Any], path: Path | None) -> str:
    lines = _file_lines(path) if path else {}
    problems = []
    for err in exc.errors(include_url=False):
        loc = tuple(str(p) for p in err["loc"])
        if loc:
            sources = ", ".join(_source_text(o, path) for o in _origins(loc, frozenset(init_values), lines, path))
        else:
            sources = "the combined settings"
        got = err.get("input")
        got_text = "" if isinstance(got, (dict, BaseModel)) or err["type"] in ("missing", "extra_forbidden") \
            else f"; got {got!r}"
        problems.append(f"  {'.'.join(loc) or '(settings)'}: {err['msg']}{got_text} ({sources})")
    return "invalid turnscope settings:\n" + "\n".join(problems)


def _leaf_paths(model: BaseModel, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            yield from _leaf_paths(value, (*prefix, name))
        else:
            yield (*prefix, name)


def _hide_secret_str(data: Any, model: Any) -> Any:
    """``data`` (a model's JSON dump) with the value of every ``SecretStr`` field replaced."""
    if isinstance(data, dict):
        out = {}
        for key, value in data.items():
            attr = getattr(model, key, None) if isinstance(model, BaseModel) else None
            out[key] = (REDACTED if value is not None else None) if isinstance(attr, SecretStr) \
                else _hide_secret_str(value, attr)
        return out
    if isinstance(data, list):
        return [_hide_secret_str(v, None) for v in data]
    return data


@contextmanager
def using_config_file(path: str | os.PathLike) -> Iterator[Path]:
    """Within the block, ``TurnscopeSettings()`` reads ``path`` as its config file (as
    ``load(config_file=path)`` does), whatever ``TURNSCOPE_CONFIG`` says."""
    token = _CONFIG_FILE.set(Path(path))
    try:
        yield Path(path)
    finally:
        _CONFIG_FILE.reset(token)
