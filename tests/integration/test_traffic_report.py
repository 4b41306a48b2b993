"""`turnscope traffic` on the shipped traces, through the CLI and the store's views.

Truths come from plain ``json`` walks of the files (tests/unit/test_agent_traces.py's hand route:
``t`` and ``api_time`` for gaps (start to start where ``api_time`` is missing), element-by-element hash comparison for shared prefixes,
sub-agent intervals from ``t`` and ``api_time``), not from the reader or the views.
"""

from __future__ import annotations

import itertools
import json

import pytest
from typer.testing import CliRunner

from loadgen.traces.kv_cache_tester import DEFAULT_DIR
from store.writer import Store
from tests.unit.test_agent_traces import TRACES, naive_common, truth, walk
from turnscope.commands import app


def cli(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, list(args), env={"COLUMNS": "4000"})
    return r.exit_code, r.output


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("traffic") / "store")
    code, out = cli("traffic", "--store", str(store.root), "--label", "shipped", str(DEFAULT_DIR))
    assert code == 0, out
    con = store.connect()
    (tid,) = con.execute("SELECT traffic_id FROM traffic_log WHERE label = 'shipped'").fetchone()
    yield con, tid, out
    con.close()


def test_counts_and_ttl_share(report):
    con, tid, out = report
    t = [truth(p) for p in TRACES]
    sessions, requests, within = (sum(x[k] for x in t) for k in ("sessions", "requests", "within_ttl"))
    assert (sessions, requests) == (35, 740)
    got = con.execute("SELECT count(*), sum(requests) FROM traffic_sessions WHERE traffic_id = ?", [tid]).fetchone()
    assert got == (sessions, requests)
    row = con.execute("SELECT follow_ups, within_ttl FROM traffic_ttl WHERE traffic_id = ? AND gap_kind = 'all' "
                      "AND configured", [tid]).fetchone()
    assert row == (requests - sessions, within)
    assert f"{sessions} sessions (11 sub-agents), {requests} requests" in out


def test_estimated_gaps_counted(report):
    """Follow-ups of a request without api_time: their gap is estimated, counted per kind and in
    the printed report (the plain-json walk's count: 104 of 705, data/traces/kv-cache-tester)."""
    con, tid, out = report
    estimated = sum(truth(p)["estimated"] for p in TRACES)
    assert estimated == 104
    got = con.execute("SELECT estimated_gaps, follow_ups FROM traffic_gaps WHERE traffic_id = ? AND gap_kind = 'all'",
                      [tid]).fetchone()
    assert got == (estimated, 705)
    assert con.execute("SELECT count(*) FROM traffic_requests WHERE traffic_id = ? AND gap_estimated",
                       [tid]).fetchone() == (estimated,)
    assert f"{estimated} gaps estimated" in out
    assert "705 follow-ups (104 estimated)" in out


def test_reusable_share(report):
    con, tid, _ = report
    total = shared = 0
    for p in TRACES:
        ss: list[list[dict]] = []
        walk(json.loads(p.read_text())["requests"], ss)
        for s in ss:
            total += sum(r["in"] for r in s)
            shared += sum(min(r["in"], 64 * naive_common(a["hash_ids"], r["hash_ids"])) for a, r in itertools.pairwise(s))
    got = con.execute("SELECT input_tokens, reusable_tokens FROM traffic_reuse WHERE traffic_id = ? AND format IS NULL",
                      [tid]).fetchone()
    assert got == (total, shared)


def test_sub_agents_overlap_their_parent(report):
    """trace_0277: 4 sub-agents inside the parent's span; by hand from t and api_time."""
    con, tid, _ = report
    doc = json.loads((DEFAULT_DIR / "trace_0277.json").read_text())
    spans = []
    parent = [r for r in doc["requests"] if r.get("type") != "subagent"]
    spans.append((parent[0]["t"], parent[-1]["t"] + parent[-1].get("api_time", 0)))
    for sub in (r for r in doc["requests"] if r.get("type") == "subagent"):
        last = sub["requests"][-1]
        spans.append((sub["t"], sub["t"] + last["t"] + last.get("api_time", 0)))
    overlapping = sum(1 for i, (a, b) in enumerate(spans)
                      if any(a < d and c < b for j, (c, d) in enumerate(spans) if j != i))
    got = con.execute("SELECT sessions, overlapping_sessions FROM traffic_overlap WHERE traffic_id = ? "
                      "AND source = 'kv-cache-tester:trace_0277'", [tid]).fetchone()
    assert got == (5, overlapping)
    assert overlapping == 5  # every sub-agent runs while the parent's session is open


def test_wrong_format_is_one_line(tmp_path):
    code, out = cli("traffic", "--store", str(tmp_path / "s"), "--format", "mooncake",
                    str(DEFAULT_DIR / "trace_0036.json"))
    assert code == 2
    line = " ".join(out.split())
    assert "trace_0036.json:1: timestamp: expected an integer >= 0, got None" in line
    assert "looks like kv_cache_tester" in line
    assert "Traceback" not in out
    assert not list((tmp_path / "s" / "runs").glob("traffic-*/traffic_requests/*.parquet"))


def test_rows_survive_batch_boundaries(tmp_path, monkeypatch):
    """Many small row groups hold every request: the counts and token sums of the plain-json walk."""
    from loadgen import traffic

    monkeypatch.setattr(traffic, "BATCH_ROWS", 97)
    rep = traffic.build_report(Store(tmp_path / "s"), [DEFAULT_DIR])
    total = sum(r["in"] for p in TRACES for s in _sessions(p) for r in s)
    assert rep.summary["requests"] == 740
    assert [r["input_tokens"] for r in rep.reuse if r["format"] is None] == [total]


def _sessions(path):
    ss: list[list[dict]] = []
    walk(json.loads(path.read_text())["requests"], ss)
    return ss


def test_workload_naming_a_claude_code_trace_as_mooncake_is_one_line(tmp_path):
    """`python -m loadgen.workload` on a workload that names a kv-cache-tester file as `mooncake`:
    exit 2 and one line naming the file, line and field (the bad-input rule), no traceback."""
    import subprocess
    import sys

    from tests.embedded_tokenizer import tokenizer_json

    wf = tmp_path / "bad.yaml"
    wf.write_text(f"name: bad\nsessions: 0\ntraces:\n  - {{format: mooncake, path: {DEFAULT_DIR / 'trace_0036.json'}}}\n")
    p = subprocess.run([sys.executable, "-m", "loadgen.workload", str(wf), "--tokenizer", str(tokenizer_json())],
                       capture_output=True, text=True, timeout=120, check=False)
    out = (p.stdout + p.stderr).strip()
    assert p.returncode == 2
    assert out.splitlines() == [(f"workload bad: {DEFAULT_DIR / 'trace_0036.json'}:1: timestamp: expected an "
                                f"integer >= 0, got None")]


def test_one_format_prints_one_reuse_row_and_two_print_each_and_all(report, tmp_path):
    """A report of one format prints only the ``all`` reuse line (its per-format row would repeat
    it); a report of two prints both formats and ``all``, whose input tokens are the two added."""
    _, _, out = report
    assert [ln.split(":")[0].strip() for ln in out.splitlines() if ln.strip().startswith("reuse (")] == ["reuse (all)"]
    tracelab = DEFAULT_DIR.parent / "tracelab_round_trace.jsonl"
    code, out2 = cli("traffic", "--store", str(tmp_path / "s"), str(DEFAULT_DIR), str(tracelab))
    assert code == 0, out2
    rows = {ln.split(":")[0].strip(): ln for ln in out2.splitlines() if ln.strip().startswith("reuse (")}
    assert set(rows) == {"reuse (all)", "reuse (kv_cache_tester)", "reuse (tracelab)"}

    def tokens(line: str) -> int:
        return int(line.split(" of ")[1].split(" input tokens")[0].replace(",", ""))
    assert tokens(rows["reuse (all)"]) == tokens(rows["reuse (kv_cache_tester)"]) + tokens(rows["reuse (tracelab)"])


def test_the_load_each_kind_of_trace_recorded(report, tmp_path):
    """kv-cache-tester files each run on their own clock: no recorded load. The Azure trace has one
    clock and no session ids: its requests per hour are the rows over the span of their timestamps
    (read here with the csv module), and its sessions and reuse are unknown, not 0."""
    import csv
    import datetime as dt

    _, _, out = report
    assert "  load: none recorded (each file is one session tree on its own clock from t = 0)" in out
    azure = DEFAULT_DIR.parent / "AzureLLMInferenceTrace_conv.csv"
    with azure.open() as fh:
        stamps = [dt.datetime.fromisoformat(r["TIMESTAMP"][:26]) for r in csv.DictReader(fh)]
    span_h = (max(stamps) - min(stamps)).total_seconds() / 3600
    code, out2 = cli("traffic", "--store", str(tmp_path / "s"), str(azure))
    assert code == 0, out2
    line = next(ln for ln in out2.splitlines() if ln.startswith("  load:"))
    rate = float(line.split(" = ")[1].split(" requests per hour")[0].replace(",", ""))
    assert rate == pytest.approx(len(stamps) / span_h, rel=2e-3)   # the line prints 3 significant figures
    assert "sessions: unknown (the trace has no session ids" in out2 and "reuse: unknown" in out2
    assert "most active at once" not in out2 and "0.0% of" not in out2
