"""Where a measured capacity ramp stops gaining, beside where the planner says 1P1D stops keeping up.

A capacity ramp (`turnscope capacity`) plays N concurrent sessions at each step: a closed loop, the
load model's ``--concurrent-sessions N`` (docs/planner/load.md). Measured, per mode: the
**knee** is the first step whose throughput (ok turns per second) is not more than 10% above the
step before it (the deployment has stopped gaining from more sessions). Forecast, per mode: the
sessions of the ramp's lightest step (a recording the forecast was not fitted on, at another load)
drawn by the load model at N concurrent sessions at their recorded pace, on one P and one D with
the ramp's KV spaces, the profile put on that step's machine speed (its speed probe); the **forecast knee** is the first N at which the planner names the
deployment overloaded (its overload test: docs/planner/load.md). Both at the ramp's own steps; the check is
whether they fall within one step of each other.

Run: ``.venv/bin/python bench/ramp_knee.py STORE [--profile embedded-cpu] [--prefill-kv-tokens N]
[--decode-kv-tokens N]`` (the KV spaces the ramp gave P and D; the aggregated worker gets both).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import itertools

import numpy as np

from core import resources
from loadgen.traces.recorded_runs import iter_recorded_runs
from planner.fit import on_run_speed, runs_shared_prefix_tokens
from planner.load import Load, LoadKind, apply_load
from planner.profile import Sourced, load_profile
from planner.simulate import PlanSettings, Traffic, plan
from store.queries.capacity import capacity_steps
from store.queries.planner_runs import probe_ttft_s
from store.writer import Store

#: A step gains when its throughput is more than this fraction above the step before it.
GAIN = 0.10


def measured_knees(steps) -> dict[str, int | None]:
    """Per mode, the first step whose throughput is within :data:`GAIN` of (or below) the step
    before it; None when every step gains."""
    out = {}
    for mode, g in steps.sort_values("users").groupby("mode"):
        knee = None
        rows = list(g.itertuples())
        for before, now in itertools.pairwise(rows):
            if now.throughput_per_s <= before.throughput_per_s * (1 + GAIN):
                knee = int(now.users)
                break
        out[mode] = knee
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("store")
    ap.add_argument("--profile", default="embedded-cpu")
    ap.add_argument("--prefill-kv-tokens", type=int, default=None)
    ap.add_argument("--decode-kv-tokens", type=int, default=None)
    ap.add_argument("--sessions", type=int, default=64, help="sessions drawn per forecast step")
    args = ap.parse_args()
    store = Store(Path(args.store))
    con = store.connect(read_only=True)
    ids = [r[0] for r in con.execute("SELECT run_id FROM runs").fetchall()]
    steps = capacity_steps(con, ids)
    con.close()
    users = sorted(steps["users"].unique())
    prof = load_profile(resources.find(args.profile, "profiles"))
    kv = prof.kv_bytes_per_token.value
    update = {}
    if args.prefill_kv_tokens:
        update["prefill_kv_space_bytes"] = Sourced(value=args.prefill_kv_tokens * kv, source="the ramp's P")
    if args.decode_kv_tokens:
        update["decode_kv_space_bytes"] = Sourced(value=args.decode_kv_tokens * kv, source="the ramp's D")
    if args.prefill_kv_tokens and args.decode_kv_tokens:
        update["aggregated_kv_space_bytes"] = Sourced(value=(args.prefill_kv_tokens + args.decode_kv_tokens) * kv,
                                                      source="the ramp's aggregated worker: P's and D's")
    prof = prof.model_copy(update=update)
    lightest = steps[steps["users"] == users[0]]
    users = [int(u) for u in users]
    print(f"ramp {steps['capacity_id'].iloc[0]}: steps {users}; forecast with profile {prof.name} from the "
          f"{users[0]}-session step's sessions ({', '.join(lightest['run_id'])})")
    forecast_knee: dict[str, int | None] = {}
    probes = probe_ttft_s(store, list(lightest["run_id"]))
    for mode, row in lightest.set_index("mode").iterrows():
        mix = Traffic.of(list(iter_recorded_runs(store.root, [row["run_id"]])))
        on_speed, factor = on_run_speed(prof, probes.get(row["run_id"]))
        shared = runs_shared_prefix_tokens(store, [row["run_id"]])
        settings = PlanSettings(decoder_kv_blocks_ttl_s=float(row["decoder_kv_blocks_ttl_s"]), handle_ttl_margin_s=5.0,
                                shared_prefix_tokens=shared, modes=(mode,))
        cells = []
        forecast_knee[mode] = None
        for n in users:
            load = Load(kind=LoadKind.CONCURRENT_SESSIONS, value=int(n), sessions=args.sessions)
            tr = apply_load(mix, load, "session").traffic
            m = plan(tr, on_speed, settings).modes[mode]
            if m.overload is not None and forecast_knee[mode] is None:
                forecast_knee[mode] = int(n)
            cells.append(f"{n}: " + (m.overload.text() if m.overload else f"p90 TTFT {np.quantile(m.ttft_s, 0.9) * 1e3:,.0f} ms"))
        speed = "" if factor is None else f" (at the lightest step's speed probe: {factor:.2f}x the profile's)"
        print(f"  forecast {mode:<10} " + "; ".join(cells) + speed)
    knees = measured_knees(steps)
    for mode, g in steps.sort_values("users").groupby("mode"):
        tput = ", ".join(f"{r.users}: {r.throughput_per_s:.2f}/s (p90 {r.ttft_p90_s * 1e3:,.0f} ms)" for r in g.itertuples())
        print(f"  measured {mode:<10} {tput}")
    print("knee (sessions): mode, measured (throughput stops gaining > 10%), forecast (first overloaded), "
          "within one step")
    for mode in knees:
        m, f = knees.get(mode), forecast_knee.get(mode)
        within = (m is not None and f is not None and abs(users.index(m) - users.index(f)) <= 1)
        print(f"  {mode:<10} measured {m}, forecast {f}: {'yes' if within else 'no'}")


if __name__ == "__main__":
    main()
