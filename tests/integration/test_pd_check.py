"""The per-run P/D check (``analysis.pd_check``) through a real store: a run whose decode worker
computed its prompts itself is failed, on the CLI's summary and by ``turnscope eval``'s status.

Truths: hand-set counters. Run ``good`` has 10 turns through P and D's ``local_compute`` rises by
10 (one recomputed last token per turn, what vLLM does when every block was loaded: measured in
test_disconnect_vllm.py); ``bad`` has the same turns and D computing 4,000 prompt tokens itself
(the prefill legs did not feed D); ``agg`` is aggregated (nothing to check); ``unscraped`` has no
decode samples (nothing to check).
"""

from __future__ import annotations

import datetime as dt
import io

from rich.console import Console

from analysis.pd_check import decode_computed_prompts, pd_check_failures
from store.writer import Store
from turnscope.commands import summaries as cli
from turnscope.conductor.evaluation import pd_checked_status

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
NAME = "vllm:prompt_tokens_by_source_total"
RUNS = {"good": ("pd-bidir", 10, 5000), "bad": ("pd", 4000, 0), "agg": ("aggregated", None, None),
        "unscraped": ("pd-bidir", None, None)}


def build(root):
    store = Store(root)
    store.init()
    for run_id, (mode, local, external) in RUNS.items():
        w = store.writer(run_id, "t", flush_interval_s=60)
        w.append("runs_log", {"label": "t", "mode": mode, "workload": "w", "history_mode": "text", "model": "m",
                              "started_at": T0, "status": "complete", "finished_at": T0, "updated_at": T0})
        for k in range(10):
            w.append("turns", {"session_id": f"{run_id}-s", "turn_index": k, "request_id": f"{run_id}-{k}",
                               "sent_at": T0 + dt.timedelta(seconds=k), "status": "ok", "ttft_s": 0.1,
                               "prompt_tokens": 400, "reuse": None if mode == "aggregated" else "miss_first_turn"})
        if local is not None:
            for i, frac in enumerate((0.0, 0.5, 1.0)):  # the first scrape counts 0
                at = T0 + dt.timedelta(seconds=i)
                for source, total in (("local_compute", local), ("external_kv_transfer", external)):
                    w.append("metric_samples", {"scraped_at": at, "endpoint": "http://127.0.0.1:8200", "role": "decode",
                                                "name": NAME, "labels": {"source": source},
                                                "value": 100.0 + frac * total})
        w.close()
    return root


def test_a_run_whose_decode_worker_computed_its_prompts_fails_the_check(tmp_path):
    root = build(tmp_path / "store")
    failures = pd_check_failures(root, list(RUNS))
    assert set(failures) == {"bad"}
    assert failures["bad"] == decode_computed_prompts("pd", 10, 4000.0, 0.0)
    assert "computed 4,000 prompt tokens itself" in failures["bad"] and "for 10 turns" in failures["bad"]
    out = io.StringIO()
    console = Console(file=out, width=200)
    assert pd_checked_status(root, "bad", "complete", console) == "failed"
    assert pd_checked_status(root, "good", "complete", console) == "complete"
    assert pd_checked_status(root, "bad", "aborted", console) == "aborted"
    assert "[bad] failed: P/D did not happen" in out.getvalue()


def test_the_summary_says_which_run_failed_and_why(tmp_path, monkeypatch):
    root = build(tmp_path / "store")
    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, width=200))
    cli.print_summary(root, list(RUNS))
    text = out.getvalue()
    assert text.count("FAILED: P/D did not happen") == 1
    assert text.index("bad: pd,") < text.index("FAILED") < text.index("agg: aggregated,")  # under its run


def test_the_rule_by_hand():
    assert decode_computed_prompts("pd-bidir", 10, 10.0, 990.0) is None  # one token per turn: P/D happened
    assert decode_computed_prompts("pd-bidir", 10, 11.0, 990.0) is not None
    assert decode_computed_prompts("aggregated", 10, 5000.0, 0.0) is None
    assert decode_computed_prompts("pd", 0, 5000.0, 0.0) is None  # no turn went through P
    assert decode_computed_prompts("pd", 10, None, None) is None  # D not scraped


def test_the_overview_shows_the_failed_run(tmp_path, monkeypatch):
    from streamlit.testing.v1 import AppTest

    from tests.integration.test_dashboard_apptest import APP, TIMEOUT_S

    root = build(tmp_path / "store")
    monkeypatch.setenv("TURNSCOPE_STORE", str(root))
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S).run()
    assert not at.exception, [e.value for e in at.exception]
    errors = [e.value for e in at.error]
    assert errors == [f"Run `bad` failed its P/D check. {decode_computed_prompts('pd', 10, 4000.0, 0.0)}"]


def canary_row(run_id, canary_id, turn, result, first_mismatch, phase="end"):
    ref = [5, 6, 7, 8]
    served = ref if first_mismatch is None else ref[:first_mismatch] + [99] * (4 - first_mismatch)
    return {"run_id": run_id, "phase": phase, "sent_at": T0, "canary_id": canary_id, "result": result,
            "reference": "prefill-0", "turn": turn, "prompt_tokens": 300, "reuse": "hit" if turn else "miss_first_turn",
            "first_mismatch": first_mismatch, "reference_ids": ref, "served_ids": served, "error": None}


def test_a_run_whose_canary_answered_wrong_tokens_fails_the_check(tmp_path, monkeypatch):
    """Truth: hand-written canary rows. ``good`` has two matching canaries and its counters say P/D
    happened; ``wrong`` has the same counters and one of its two canaries differing at turn 1, token 2."""
    root = tmp_path / "store"
    store = Store(root)
    store.init()
    for run_id in ("good", "wrong"):
        w = store.writer(run_id, "t", flush_interval_s=60)
        w.append("runs_log", {"label": "t", "mode": "pd-bidir", "workload": "w", "history_mode": "text", "model": "m",
                              "started_at": T0, "status": "complete", "finished_at": T0, "updated_at": T0})
        w.append("run_canaries", canary_row(run_id, "c1", 0, "match", None, "start"))
        w.append("run_canaries", canary_row(run_id, "c1", 1, "match", None, "start"))
        bad = run_id == "wrong"
        w.append("run_canaries", canary_row(run_id, "c2", 0, "mismatch" if bad else "match", None))
        w.append("run_canaries", canary_row(run_id, "c2", 1, "mismatch" if bad else "match", 2 if bad else None))
        w.close()
    failures = pd_check_failures(root, ["good", "wrong"])
    assert set(failures) == {"wrong"}
    assert "1 of 2 known-answer canaries" in failures["wrong"] and "turn 1, token 2" in failures["wrong"]
    out = io.StringIO()
    assert pd_checked_status(root, "wrong", "complete", Console(file=out, width=300)) == "failed"
    assert pd_checked_status(root, "good", "complete", Console(file=out, width=300)) == "complete"
    monkeypatch.setattr(cli, "console", Console(file=out, width=300))
    cli.print_summary(root, ["good", "wrong"])
    text = out.getvalue()
    assert text.count("known-answer canaries: 2, 0 with wrong tokens, 0 failed") == 1
    assert text.count("known-answer canaries: 2, 1 with wrong tokens, 0 failed") == 1
    assert "FAILED: The P/D path answered wrong tokens" in text
