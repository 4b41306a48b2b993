"""``turnscope recommend`` through its CLI on a shipped trace and profile: the ledger and the
recommendation are printed as forecasts with their inputs; bad input is refused with a clear message."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from serving.topology import load_topology
from turnscope.commands import app

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


def held_out_profile(tmp_path: Path) -> Path:
    """vendor-h200 with hand-made held-out errors: TTFT ratio p10-p90 0.8-1.25 (pd), 0.85-1.3
    (pd-bidir), 0.9-1.2 (pd-nocache); D hit-rate error -0.1..+0.05 (pd-bidir)."""
    import yaml

    data = yaml.safe_load(PROFILE.read_text())
    data["held_out"] = {"split": "hand-made", "runs": 4, "turns": 40,
                        "ttft_ratio": {"pd-nocache": [0.9, 1.2], "pd": [0.8, 1.25], "pd-bidir": [0.85, 1.3]},
                        "hit_rate_error": {"pd-bidir": [-0.1, 0.05]}}
    path = tmp_path / "held.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_recommend_stores_ledger_and_recommendation_with_intervals(tmp_path):
    import duckdb

    store = tmp_path / "store"
    r = invoke(str(TRACE), "--profile", str(held_out_profile(tmp_path)), "--store", str(store), "--label", "rec",
               "--topology", str(ROOT / "data/topologies/vendor-h200-1p1d.yaml"), "--max-prefill-workers", "2",
               "--ttft-slo-s", "0.5", "--write-topology", str(tmp_path / "written.yaml"))
    assert r.exit_code == 0, r.output
    assert "80% interval" in r.output and "Topology file diff (current -> recommended; base: topology vendor-h200-1p1d)" in r.output
    con = duckdb.connect()
    shards = f"{store}/runs/plan-*"
    led = con.execute(f"SELECT * FROM read_parquet('{shards}/plan_ledger/*.parquet')").df().set_index("strategy")
    rec = con.execute(f"SELECT * FROM read_parquet('{shards}/plan_recommendations/*.parquet')").df().iloc[0]
    log = con.execute(f"SELECT label, forecast_label FROM read_parquet('{shards}/plan_log/*.parquet')").fetchall()
    assert log == [("rec", "FORECAST (profile vendor-h200) at the recorded clock")]   # one tree: its own load
    assert set(led.index) == {"recompute", "pd", "pd+host", "pd-bidir", "pd-bidir+host"}
    # each TTFT interval is the forecast times the held-out ratios of the mode it is costed as
    for strategy, (lo, hi) in (("recompute", (0.9, 1.2)), ("pd", (0.8, 1.25)), ("pd-bidir", (0.85, 1.3))):
        x = led.loc[strategy]
        assert x["ttft_p50_later_interval_low_s"] == pytest.approx(x["ttft_p50_later_s"] * lo)
        assert x["ttft_p50_later_interval_high_s"] == pytest.approx(x["ttft_p50_later_s"] * hi)
    assert led.loc[["pd+host", "pd-bidir+host"], "ttft_p50_later_interval_low_s"].isna().all()
    # the recommendation's printed figures are the stored ones; its topology loads with its knobs
    assert rec["recommended_label"] in r.output and rec["topology_diff"] in r.output
    path = tmp_path / "written.yaml"   # --write-topology: the file stored with the recommendation
    assert path.read_text() == rec["recommended_topology"]
    topo = load_topology(path)
    setting = json.loads(rec["recommended_setting"])
    assert len(topo.prefill) == setting["prefill_workers"] and topo.proxy.prefill_routing == setting["routing"]
    assert topo.connector.decoder_kv_blocks_ttl == int(setting["ttl_s"])
    assert rec["recommended_ttft_p90_s"] <= 0.5 or not rec["feasible"]
    assert rec["recommended_ttft_mean_interval_low_s"] < rec["recommended_ttft_mean_s"] < rec["recommended_ttft_mean_interval_high_s"]


def test_written_topology_names_the_same_model_wherever_it_is_written(tmp_path):
    """The embedded topology names its model relative to its own folder; the recommended file written
    two folders elsewhere loads the very model the current file loads (not a path that only made
    sense next to data/topologies/)."""
    base = ROOT / "data/topologies/embedded-cpu.yaml"
    out = tmp_path / "a" / "b" / "rec.yaml"
    out.parent.mkdir(parents=True)
    r = invoke(str(TRACE), "--profile", str(ROOT / "data/profiles/embedded-cpu.yaml"), "--platform", "cpu",
               "--topology", str(base), "--write-topology", str(out))
    assert r.exit_code == 0, r.output
    assert load_topology(out).model == load_topology(base).model
    assert not Path(load_topology(out).model).is_relative_to(tmp_path)


def test_recorded_runs_bring_their_shared_system_prompt(tmp_path, monkeypatch):
    """``--run-ids``: the system prompt the sessions share comes from those runs' recorded first turns,
    as `turnscope plan` takes it (planner.fit.recorded_shared_prefix_tokens, given the
    runs' own turns); a trace file has none. Read back from the stored settings."""
    import duckdb

    from planner import fit
    from tests import planner_store

    seen = []

    def shared(turns):
        seen.append(sorted(set(turns["run_id"])))
        return 384

    monkeypatch.setattr(fit, "recorded_shared_prefix_tokens", shared)
    root = planner_store.build(tmp_path / "runs")
    run = planner_store.RUNS["pd-bidir"]

    def stored(out: Path) -> int:
        (settings,) = duckdb.connect().execute(
            f"SELECT settings FROM read_parquet('{out}/runs/plan-*/plan_log/*.parquet')").fetchone()
        return json.loads(settings)["shared_prefix_tokens"]

    r = invoke(str(root), "--run-ids", run, "--profile", str(PROFILE), "--store", str(tmp_path / "a"))
    assert r.exit_code == 0, r.output
    assert seen == [[run]] and stored(tmp_path / "a") == 384
    r = invoke(str(TRACE), "--profile", str(PROFILE), "--store", str(tmp_path / "b"))
    assert r.exit_code == 0, r.output
    assert stored(tmp_path / "b") == 0 and seen == [[run]]


DIR = ROOT / "data/traces/kv-cache-tester"


def test_own_clock_traces_are_refused_without_a_load():
    r = invoke(str(DIR), "--profile", str(PROFILE))
    assert r.exit_code != 0 and "record no load" in r.output and "--sessions-per-hour" in r.output
    r = invoke(str(DIR), "--profile", str(PROFILE), "--sessions-per-hour", "10", "--concurrent-sessions", "3")
    assert r.exit_code != 0 and "give one load" in r.output


@pytest.mark.parametrize("rate", ["10", "1000"])
def test_recommend_at_a_load_names_overload_and_no_ttft_past_the_horizon(tmp_path, rate):
    """The 24 shipped traces drawn 60 times at two loads: the fleet table first, the load stated, and
    no printed TTFT longer than the horizon nor a speed-up next to a setting that cannot keep up; the
    stored fleets are the printed ones."""
    import re

    import duckdb

    store = tmp_path / "store"
    r = invoke(str(DIR), "--profile", str(PROFILE), "--ttft-slo-s", "2", "--sessions-per-hour", rate, "--sessions",
               "60", "--workers", "1", "--store", str(store), "--max-prefill-workers", "8", "--max-decode-workers", "8")
    assert r.exit_code == 0, r.output
    out = r.output
    load = f"{int(rate):,} new sessions per hour (Poisson starts, seed 0; 60 sessions drawn from 24 session trees)"
    assert out.index("Fleet per strategy") < out.index("Ledger of retention strategies") and load in out
    # the ledger and the recommendation each say the load they were forecast at, not only the heading
    assert out.count(load) >= 4
    assert out.count("no held-out interval") == 2     # said once per report part (head and ledger), not per figure
    horizon = re.search(r"requests over ([\d.,]+) (h|min|s)\b", out)
    horizon_s = float(horizon.group(1).replace(",", "")) * {"h": 3600, "min": 60, "s": 1}[horizon.group(2)]
    ttfts = [float(v.replace(",", "")) / 1e3 for v in re.findall(r"(?:p90|p50|mean TTFT) ([\d,]+\.\d) ms", out)]
    assert ttfts and max(ttfts) < horizon_s
    for line in out.splitlines():
        if "overloaded" in line:
            assert "speed-up" not in line.split("overloaded")[1].split(";")[0] or "no speed-up" in line
    con = duckdb.connect()
    fleets = con.execute(f"SELECT * FROM read_parquet('{store}/runs/plan-*/plan_fleets/*.parquet')").df()
    assert len(fleets) == 5 and fleets["load_value"].eq(float(rate)).all() and fleets["recommended"].sum() <= 1
    for f in fleets.itertuples():
        if f.overloaded:
            assert pd.isna(f.ttft_p90_s)
        elif f.meets_slo:
            assert f"{f.prefill_workers}P {f.decode_workers}D" in out and f"p90 {f.ttft_p90_s * 1e3:,.1f} ms" in out
