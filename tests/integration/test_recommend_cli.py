"""``turnscope recommend`` through its CLI on a shipped trace and profile: the ledger and the
recommendation are printed as forecasts with their inputs; bad input is refused with a clear message."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from turnscope.cli import app

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "data/traces/kv-cache-tester/trace_0036.json"
PROFILE = ROOT / "data/profiles/vendor-h200.yaml"


def invoke(*args: str):
    return CliRunner().invoke(app, ["recommend", *args], env={"COLUMNS": "4000"})


def test_recommend_prints_ledger_and_diff():
    r = invoke(str(TRACE), "--profile", str(PROFILE), "--gpu-hour-usd", "4", "--host-gib-hour-usd", "0.01",
               "--serve-model", "Qwen/Qwen3-32B")
    assert r.exit_code == 0, r.output
    out = r.output
    assert "Ledger of retention strategies (FORECAST (profile vendor-h200)" in out
    for strategy in ("recompute", "pd+host", "pd-bidir+host"):
        assert f"  {strategy} " in out
    assert "Recommendation (FORECAST (profile vendor-h200)" in out
    assert "--- current" in out and "+++ recommended" in out
    assert "prices: GPU-hour $4, host GiB-hour $0.01" in out


def test_recommend_without_prices_gives_no_money():
    r = invoke(str(TRACE), "--profile", str(PROFILE))
    assert r.exit_code == 0, r.output
    assert "n/a (no price)" in r.output and "USD" not in r.output


def test_recommend_refuses_bad_input():
    r = invoke(str(TRACE), "--profile", str(PROFILE), "--current-strategy", "offload")
    assert r.exit_code != 0 and "--current-strategy 'offload'" in r.output
    r = invoke(str(TRACE), "--profile", str(PROFILE), "--gpu-hour-usd", "-1")
    assert r.exit_code != 0 and "--gpu-hour-usd must not be negative" in r.output
