"""What a client that strips the reasoning of earlier replies costs the bidirectional reuse: the demo's
workload with and without the workload's ``history_rewrite`` (docs/workloads.md), interleaved on one
``pd-bidir`` stack.

The demo's workload as a workload file: the tau-bench airline replay, ``--sessions`` conversations
of at most ``--max-turns`` turns, replies of ``--max-tokens`` (``ignore_eos``), 0.5 s between turns
(``turnscope demo``'s settings), text history. Variant ``as-returned`` sends the replies back as
the server returned them; ``stripped-<S>`` sets ``history_rewrite: {strip_reasoning: true,
reasoning_share: S}`` (the embedded model emits no ``<think>``: the first share S of each reply's
characters stands in for its reasoning, which like real reasoning comes before the answer; 1.0: the
whole reply, as an agent's turn that is reasoning and a tool call). One ``pd-bidir`` stack plays
the runs A B C A B C ... (``--pairs`` rounds, each run with its own cache salt: a cold prefix
cache), then per variant, over the ok later turns (``turn_index >= 1``), it prints:

* the hit rate (turns whose reuse outcome is ``hit``: P pulled D's blocks);
* tokens per turn shared with the previous prompt + reply (``expected_reusable_tokens``), pulled
  from D (``reused_tokens``) and from P's own prefix cache (``prefill_cached_tokens``);
* TTFT p50 and mean;

and the planner's FORECAST of the same runs (profile ``embedded-cpu``), whose reuse per turn is
the stored ``expected_reusable_tokens``: a second route to the hit rate and the tokens.

    .venv/bin/python bench/history_drift.py --pairs 3
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from serving.embedded_model import ensure_model
from store.writer import Store
from turnscope.conductor.evaluation import RunPlan, default_settings, run_eval
from turnscope.conductor.settings import TurnscopeSettings

AS_RETURNED = "as-returned"

SUMMARY_SQL = """
SELECT r.workload AS variant, count(*) AS turns,
       avg(CASE WHEN t.reuse = 'hit' THEN 1.0 ELSE 0.0 END) AS hit_rate,
       avg(t.expected_reusable_tokens) AS shared_tokens,
       avg(coalesce(t.reused_tokens, 0)) AS pulled_tokens,
       avg(coalesce(t.prefill_cached_tokens, 0)) AS p_cached_tokens,
       avg(t.prompt_tokens) AS prompt_tokens,
       median(t.ttft_s) AS ttft_p50_s, avg(t.ttft_s) AS ttft_mean_s
FROM turns t JOIN runs r USING (run_id)
WHERE t.run_id IN (SELECT unnest(?)) AND t.status = 'ok' AND t.turn_index >= 1
GROUP BY ALL ORDER BY variant
"""

PER_RUN_SQL = """
SELECT t.run_id, r.workload AS variant, r.status, count(*) AS turns,
       avg(CASE WHEN t.reuse = 'hit' THEN 1.0 ELSE 0.0 END) AS hit_rate,
       avg(coalesce(t.reused_tokens, 0)) AS pulled_tokens, median(t.ttft_s) AS ttft_p50_s
FROM turns t JOIN runs r USING (run_id)
WHERE t.run_id IN (SELECT unnest(?)) AND t.status = 'ok' AND t.turn_index >= 1
GROUP BY ALL ORDER BY min(t.sent_at)
"""


def workload(name: str, sessions: int, max_turns: int, max_tokens: int, share: float | None) -> dict:
    """The demo's tau-bench replay as a workload file's content, ``share`` set: reasoning stripped."""
    w = {"name": name, "description": "the demo's tau-bench airline replay" + (
        f", reasoning stripped (stand-in share {share})" if share is not None else ""),
         "seed": 0, "sessions": 0, "timeout_s": 120,
         "traces": [{"format": "taubench", "sessions": sessions, "max_turns": max_turns,
                     "output_tokens": max_tokens, "gaps": {"tool": 0.5, "think": 0.5}}]}
    if share is not None:
        w["history_rewrite"] = {"strip_reasoning": True, "reasoning_share": share}
    return w


def forecast(store: Path, run_ids: dict[str, list[str]]) -> list[dict]:
    """Per variant: the planner's FORECAST of the same recorded runs (profile ``embedded-cpu``,
    ``pd-bidir``), whose reuse per turn is the stored ``expected_reusable_tokens``: the hit rate
    and tokens pulled / from P's own cache per ok later turn, a second route to the measured ones."""
    import numpy as np

    from loadgen.traces.recorded_runs import read_recorded_runs
    from planner.profile import load_profile
    from planner.simulate import OUTCOMES, PlanSettings, plan

    profile = load_profile(ROOT / "data" / "profiles" / "embedded-cpu.yaml")
    out = []
    for variant, ids in run_ids.items():
        p = plan(read_recorded_runs(store, ids), profile, PlanSettings(modes=("pd-bidir",), separate_sources=True))
        m, later = p.modes["pd-bidir"], p.traffic.request_index >= 1
        out.append({"variant": variant, "turns": int(later.sum()),
                    "hit_rate": float((np.array(OUTCOMES)[m.outcome][later] == "hit").mean()),
                    "pulled_tokens": float(m.pulled_tokens[later].mean()),
                    "p_cached_tokens": float(m.local_tokens[later].mean())})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=2, help="rounds: each plays every variant once, in turn")
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reasoning-shares", default="1.0,0.5",
                    help="comma-separated stand-in shares, one stripped variant each (stripped-<share>)")
    ap.add_argument("--store", type=Path, default=ROOT / "data")
    ap.add_argument("--label", default="drift")
    a = ap.parse_args(argv)

    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S")
    wdir = a.store / "runs" / "_drift" / stamp
    wdir.mkdir(parents=True, exist_ok=True)
    shares = {AS_RETURNED: None} | {f"stripped-{float(x)}": float(x) for x in a.reasoning_shares.split(",")}
    paths = {}
    for v, share in shares.items():
        paths[v] = wdir / f"{v}.yaml"
        paths[v].write_text(yaml.safe_dump(workload(v, a.sessions, a.max_turns, a.max_tokens, share)))
    model = ensure_model(TurnscopeSettings.load().model)
    s = default_settings(model, modes=["pd-bidir"], histories=["text"], sessions=0, users=1,
                         max_tokens=a.max_tokens, gap_s=0.5, store=a.store, label=a.label, schedule="sequential")
    plans = [RunPlan(run_id=f"{a.label}-{stamp}-{i}-{v}", history="text",
                     settings=s.model_copy(update={"workload": paths[v]}))
             for i in range(a.pairs) for v in shares]
    run_ids = run_eval(s, runs={"pd-bidir": plans})
    con = Store(a.store).connect()
    try:
        per_run = con.execute(PER_RUN_SQL, [run_ids]).df()
        summary = con.execute(SUMMARY_SQL, [run_ids]).df()
    finally:
        con.close()
    print("\nper run, in the order played (ok later turns):")
    print(per_run.to_string(index=False))
    print("\nper variant (ok later turns; tokens are means per turn):")
    print(summary.to_string(index=False))
    by_variant = {v: [r for r in run_ids if r.endswith(f"-{v}")] for v in shares}
    print("\nFORECAST (embedded-cpu profile) of the same runs, from their expected_reusable_tokens:")
    print(pd.DataFrame(forecast(a.store, by_variant)).to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
