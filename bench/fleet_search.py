"""Fleet sizing at a fleet's scale: the 24 shipped kv-cache-tester traces drawn at a rate until the
traffic holds about 49,334 requests (the size of a 710-trace public corpus of the same set, which
the repo does not ship), then one setting forecast and a whole ``turnscope recommend`` (fleet
sizing per strategy up to 16 P and 16 D, the knob search, the load curve) timed, with the peak
memory. Targets (docs/planner/fleet.md): one setting <= 5 s, the whole recommendation (>= 100
settings) <= 60 s, <= 1 GiB; at SLO 2 s a fleet for every strategy whose fleet sized at SLO 5 s
already meets 2 s; no TTFT printed above 10x the SLO. Prints each figure beside its target.

Run: ``.venv/bin/python bench/fleet_search.py [--requests 49334] [--rate 100] [--workers N]``;
``--requests 500000`` for the 10x run; ``--compare-rounds`` also times the whole recommendation with
paced sends settled round by round (the route before the one pass), side by side in the same run. The machine is shared: the load average is printed with the
figures.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from planner.cli_plan import read_traffic
from planner.cli_recommend import run_recommend
from planner.executor import LocalExecutor
from planner.fleet import Fleet, FleetLimits, evaluate_fleet
from planner.load import Load, LoadKind, at_load
from planner.profile import load_profile
from planner.recommend import Setting
from planner.simulate import PlanSettings

TRACES = REPO / "data" / "traces" / "kv-cache-tester"
PROFILE = REPO / "data" / "profiles" / "vendor-h200.yaml"
ONE_SETTING_S, WHOLE_S, MEMORY_GIB = 5.0, 60.0, 1.0


def peak_rss_gib() -> float:
    """The peak resident memory of this process and of its finished children (the pool), GiB."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) / 2**20   # ru_maxrss is KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=49_334, help="requests the drawn traffic should hold (about)")
    ap.add_argument("--rate", type=float, default=100.0, help="new sessions per hour")
    ap.add_argument("--workers", type=int, default=None, help="processes (default: the machine's cores)")
    ap.add_argument("--compare-rounds", action="store_true",
                    help="also time the whole recommendation with paced sends settled round by round (the route "
                         "before the one pass), in the same run, and print both answers")
    ap.add_argument("--settings-only", action="store_true", help="time the single settings only, not the whole "
                                                                  "recommendation (for the 10x run)")
    args = ap.parse_args()
    mix, _inputs = read_traffic([TRACES], None)
    per_tree = len(mix) / len(set(mix.source))
    sessions = max(1, round(args.requests / per_tree))
    load = Load(kind=LoadKind.SESSIONS_PER_HOUR, value=args.rate, sessions=sessions)
    loaded = at_load(mix, ["kv_cache_tester"], load)
    tr = loaded.traffic
    prof = load_profile(PROFILE)
    print(f"traffic: {loaded.label()}; machine: {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f} at the start")
    limits = FleetLimits(ttft_slo_s=2.0)
    times = {}
    for strategy, fleet in (("pd", Fleet(4, 2)), ("pd-bidir", Fleet(4, 2)), ("pd-bidir", Fleet(16, 16))):
        t0 = time.perf_counter()
        e = evaluate_fleet(tr, prof, PlanSettings(), strategy, fleet, limits)
        times[(strategy, fleet.label())] = time.perf_counter() - t0
        print(f"one setting, {strategy} {fleet.label()}: {times[(strategy, fleet.label())]:.2f} s "
              f"(target <= {ONE_SETTING_S:g} s; {e.ttft_text()})")
    if args.settings_only:
        print(f"peak memory: {peak_rss_gib():.2f} GiB (target <= {MEMORY_GIB:g} GiB); load average at the end: "
              f"{os.getloadavg()[0]:.1f}")
        return
    text, whole = _whole(load, args.workers)
    settings = _settings_forecast(text)
    worst = max(times.values())
    print(f"whole recommendation: {whole:.1f} s for {settings} settings forecast (target <= {WHOLE_S:g} s, >= 100 "
          f"settings): {whole / WHOLE_S:.2f}x the target")
    print(f"slowest single setting: {worst:.2f} s, {worst / ONE_SETTING_S:.2f}x the target")
    print(f"peak memory (this process or one pool process): {peak_rss_gib():.2f} GiB (target <= {MEMORY_GIB:g} GiB)")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    print("\n".join(line for line in text.splitlines() if line.startswith("Fleet per strategy")
                    or line.startswith("  ") and "fleets tried" in line))
    _check_targets(text, tr, prof, load, args.workers)
    if args.compare_rounds:
        from planner import simulate

        simulate.ONE_PASS = False   # the pool's processes are forked after this: they take it too
        old_text, old_whole = _whole(load, args.workers)
        simulate.ONE_PASS = True
        print(f"\nside by side, the whole recommendation: one pass {whole:.1f} s, round by round {old_whole:.1f} s "
              f"({old_whole / whole:.2f}x); peak memory of either {peak_rss_gib():.2f} GiB; load average "
              f"{os.getloadavg()[0]:.1f}")
        for name, t in (("one pass", text), ("round by round", old_text)):
            print(f"{name}:")
            print("\n".join(line for line in t.splitlines() if line.startswith("  ") and "fleets tried" in line))


def _whole(load, workers) -> tuple[str, float]:
    """One whole ``turnscope recommend`` at SLO 2 s up to 16P16D: (its text, seconds)."""
    t0 = time.perf_counter()
    text = run_recommend([TRACES], profile_path=PROFILE, format=None, current=Setting("pd-bidir"), margin_s=30.0,
                         ttft_slo_s=2.0, d_kv_gib=None, gpu_hour_usd=None, host_gib_hour_usd=None,
                         max_prefill_workers=16, max_decode_workers=16, serve_model="MODEL", load=load,
                         executor=LocalExecutor(workers))
    return text, time.perf_counter() - t0


def _check_targets(text: str, tr, prof, load, workers) -> None:
    """The answer's targets: no TTFT printed above 10x the SLO (every "N ms" of the report), and at
    SLO 2 s a fleet for each strategy whose fleet sized at SLO 5 s already has a p90 within 2 s."""
    import re

    from planner.fleet import FleetJob, size_fleets
    from planner.strategies import STRATEGIES

    worst = max((float(m.replace(",", "")) for m in re.findall(r"([\d,]+(?:\.\d+)?) ms", text)), default=0.0)
    print(f"largest TTFT printed: {worst:,.1f} ms (target <= 10x the 2 s SLO = 20,000 ms): "
          f"{'met' if worst <= 20_000 else 'MISSED'}")
    at2 = {line.split()[0]: "no fleet meets" not in line for line in text.splitlines()
           if line.startswith("  ") and "fleets tried" in line}
    t0 = time.perf_counter()
    five = size_fleets(FleetJob(tr, prof, PlanSettings(ttft_slo_s=5.0), FleetLimits(ttft_slo_s=5.0)),
                       tuple(STRATEGIES), LocalExecutor(workers))
    owed = [s.strategy for s in five if s.best is not None and s.best.ttft_p90_s <= 2.0]
    missing = [s for s in owed if not at2.get(s, False)]
    print(f"sized at SLO 5 s ({time.perf_counter() - t0:.1f} s): "
          + "; ".join(f"{s.strategy} {s.best.fleet.label()} p90 {s.best.ttft_p90_s * 1e3:,.0f} ms" if s.best else
                      f"{s.strategy} none" for s in five))
    print(f"strategies whose 5 s fleet meets 2 s: {', '.join(owed) or 'none'}; with a fleet at 2 s: "
          f"{len(owed) - len(missing)} of {len(owed)} ({'met' if not missing else 'MISSED: ' + ', '.join(missing)})")


def _settings_forecast(text: str) -> int:
    """Settings forecast in a recommendation: fleets tried, settings searched, load-curve points, the
    ledger's strategies, the what-ifs (two each) and each changed knob alone."""
    import re

    fleets = sum(int(n) for n in re.findall(r"\((\d+) fleets tried\)", text))
    searched = int(re.search(r"(\d+) settings searched", text).group(1))
    curve = sum(line.count(": ") for line in text.split("Each strategy's fleet at other loads")[-1]
                .split("\n\n")[0].splitlines()[1:]) if "Each strategy's fleet at other loads" in text else 0
    ledger = sum(1 for line in text.split("Ledger of retention strategies")[-1].split("\n\n")[0].splitlines()
                 if re.match(r"  (recompute|pd)\S* +hit rate", line))
    what_ifs = 2 * sum(1 for line in text.splitlines() if re.match(r"    (P's KV space|two P workers|gaps halved)", line))
    knobs = sum(1 for line in text.splitlines() if line.startswith("  knob "))
    return fleets + searched + curve + ledger + what_ifs + knobs


if __name__ == "__main__":
    main()
