"""``turnscope plan``: read the traffic, get the profile (a file, or fitted from recorded runs),
plan, summarise, check against the recorded runs when given, write to the store, and say it in
plain text. Every line of the text is labelled as a FORECAST with its profile (docs/planner/overview.md)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from analysis import speedup
from analysis.plan_check import (
    CHECK_MEANING,
    check_summary,
    frontier_highlights,
    headline_check,
    with_interval,
)
from loadgen.traces.formats import RECORDED_RUNS, detect_format, iter_agent_requests
from planner import summary
from planner.check import check_runs
from planner.fit import fit_profile, runs_shared_prefix_tokens
from planner.load import Load, at_load
from planner.plan_store import new_plan_id, write_plan
from planner.profile import CostProfile, GiB, Sourced, load_profile
from planner.simulate import BIDIR_MODES, PlanSettings, Traffic, plan
from serving.kv_size import kv_bytes_per_token_of_config, read_config
from store.writer import Store


def read_traffic(paths: Sequence[Path], format: str | None, run_ids: Sequence[str] | None = None
                 ) -> tuple[Traffic, list[dict]]:
    """Every request of ``paths`` (a store directory: its runs, or only ``run_ids``)."""
    from loadgen.traces.recorded_runs import iter_recorded_runs

    reqs, inputs = [], []
    for path in paths:
        fmt = format or detect_format(path)
        inputs.append({"path": str(path), "format": fmt})
        if fmt == RECORDED_RUNS and run_ids:
            reqs.extend(iter_recorded_runs(path, run_ids))
        else:
            reqs.extend(iter_agent_requests(path, fmt))
    return Traffic.of(reqs), inputs


def _ms(x: float) -> str:
    return f"{x * 1e3:,.1f} ms"


def _gib(b: float) -> str:
    g = b / GiB
    return f"{g:,.0f} GiB" if g >= 100 else f"{g:,.3g} GiB"


def _ms_n(x: float) -> str:
    return f"{x * 1e3:,.1f}"


def _x(x: float) -> str:
    return f"{x:.2f}"


def _pct(x: float) -> str:
    return f"{x * 100:.1f}"


def describe(p, sp: pd.DataFrame, fr: pd.DataFrame, sessions: pd.DataFrame, checks: pd.DataFrame | None) -> str:
    """The plan in plain text, every figure labelled as a forecast with its profile."""
    tag = p.profile.label()
    head = (f"{tag}: {len(p.traffic):,} requests, {len(set(p.traffic.session_code)):,} sessions; proxy TTL "
            f"{p.settings.proxy_ttl_s:.0f} s (decoder_kv_blocks_ttl {p.settings.decoder_kv_blocks_ttl_s:.0f} s), "
            f"threshold {p.settings.kv_recompute_threshold} tokens.")
    lines = [head]
    curve = p.profile.prefill_a1_s_per_token.source.split(": ")[0]
    lines.append(f"  prefill curve of profile {p.profile.name}: {curve} (every figure's source: the profile file)")
    lines += [f"  note: {n}" for n in p.notes]
    lines.append(interval_line(p.profile))
    lines.append(f"\nSpeed-up per mode pair ({tag}; {speedup.MEANING}, median TTFT from the second turn on, "
                 f"as on the Overview, with its 95% CI over sessions):")
    over = {mode: m.overload for mode, m in p.modes.items() if m.overload is not None}
    for mode, o in over.items():
        lines.append(f"  {mode}: {o.text()}: no TTFT and no speed-up is forecast for it at this load")
    for r in sp.itertuples():
        if r.treatment in over or r.baseline in over:
            continue
        lines += speedup_lines(r, p.profile.held_out is not None)
    for mode in BIDIR_MODES:
        if mode in p.modes:
            m = p.modes[mode]
            counts = pd.Series(m.outcome_names()).value_counts()
            lines.append(f"  {mode} outcomes: " + ", ".join(f"{k} {v:,}" for k, v in counts.items())
                         + f"; D pinned at most {m.peak_held_bytes() / GiB:,.2f} GiB, {m.held_gib_s():,.1f} GiB-s")
    lines.append(f"\nTTL x D-memory frontier ({tag}; the rows that matter of {len(fr)} re-plans, all on the "
                 "Plan page):")
    for r in frontier_highlights(fr).itertuples():
        space = "unbounded" if pd.isna(r.decode_kv_space_bytes) else _gib(r.decode_kv_space_bytes)
        iv = with_interval if p.profile.held_out else _plain
        rate = iv(f"{r.hit_rate:.1%}", r.hit_rate_interval_low, r.hit_rate_interval_high, _pct, "%")
        saved = ("not forecast (overloaded)" if pd.isna(r.ttft_saved_s) else f"{r.ttft_saved_s:,.1f} s")
        lines.append(f"  {r.mode} TTL {r.decoder_kv_blocks_ttl_s:,.0f} s, D {space}: hit rate {rate}, TTFT saved "
                     f"{saved}, peak {r.peak_held_bytes / GiB:,.2f} GiB, {r.held_gib_s:,.1f} GiB-s, "
                     f"{r.d_full_events} lost to D full [{r.why}]")
    lines.append(f"\nSessions whose pauses or edits defeat reuse ({tag}; worst 10 of {len(sessions)}):")
    for r in sessions.head(10).itertuples():
        lines.append(f"  {r.mode} {r.source} {r.session_id}: {r.lost_tokens:,} tokens not reused: {r.reason}")
    if checks is not None and not checks.empty:
        lines.append(f"\nChecked against the recorded runs ({CHECK_MEANING}):")
        for r in check_summary(checks).itertuples():
            lines.append(f"  {r.mode}: outcome {r.outcome_matches}/{r.ok_turns} ok turns "
                         f"({'pass' if r.outcome_check else 'FAIL'}), TTFT MARE {r.ttft_mare:.1%} "
                         f"({'pass' if r.ttft_check else 'FAIL'}, bound 25%)")
        hc = headline_check(checks)
        if not hc.empty:
            lines.append("  The Overview's speed-up of these runs, measured and forecast (each run planned alone in "
                         "its own mode):")
            for r in hc.itertuples():
                lines.append(f"    {r.treatment} vs {r.baseline}: measured {speedup.fmt(r.measured_speedup)}, "
                             f"forecast {speedup.fmt(r.forecast_speedup)} ({r.forecast_error:+.1%})")
        for r in checks[checks["why"].notna()].head(20).itertuples():
            lines.append(f"    {r.checked_run_id} {r.session_id} turn {r.turn_index}: {r.why}")
    return "\n".join(lines)


def _plain(text: str, low: float, high: float, fmt, unit: str = "") -> str:
    return text


def interval_line(prof: CostProfile) -> str:
    """Where the plan's forecast intervals come from, or that there are none."""
    if prof.held_out is None:
        return (f"  intervals: no held-out interval (profile {prof.name} was not checked on runs it was not "
                "fitted on: `turnscope plan-check ... --write-profile`)")
    return (f"  intervals: 80%, from the held-out errors stored with profile {prof.name} ({prof.held_out.split}; "
            f"{prof.held_out.runs} runs, {prof.held_out.turns:,} turns)")


def speedup_lines(r, has_intervals: bool) -> list[str]:
    """A ``plan_speedups`` row in words: the headline (the Overview's convention) with its CI and
    forecast interval ("no held-out interval" without one), the medians (with their intervals when
    ``has_intervals``), then the secondary figures (means, queueing), labelled as such."""
    head = with_interval(speedup.fmt(r.speedup), r.speedup_interval_low, r.speedup_interval_high, _x, "x")
    ci = speedup.fmt_ci(r.speedup_ci_low, r.speedup_ci_high)
    iv = with_interval if has_intervals else _plain
    t_med = iv(_ms(r.treatment_ttft_median_s), r.treatment_ttft_interval_low_s, r.treatment_ttft_interval_high_s,
               _ms_n, " ms")
    b_med = iv(_ms(r.baseline_ttft_median_s), r.baseline_ttft_interval_low_s, r.baseline_ttft_interval_high_s,
               _ms_n, " ms")
    return [(f"  {r.treatment} vs {r.baseline}: {speedup.LABEL} {head}, 95% CI {ci}; median TTFT {t_med} vs "
            f"{b_med} over {r.later_requests:,} later requests ({r.treatment_hits:,} hits)"),
            (f"    secondary: mean TTFT {_ms(r.treatment_ttft_mean_s)} vs {_ms(r.baseline_ttft_mean_s)} "
            f"({r.mean_speedup:.2f}x over all {r.requests:,} requests, {r.later_mean_speedup:.2f}x over later ones); "
            f"queueing {r.treatment_queue_share:.0%} vs {r.baseline_queue_share:.0%} of mean TTFT")]


def with_model(prof: CostProfile, model: Path) -> CostProfile:
    """``prof`` with the KV bytes per token of ``model`` (a model directory or its config.json;
    formulas in :mod:`serving.kv_size`, docs/planner/overview.md). Raises serving.kv_size.KVSizeError (a
    ValueError naming the file and field) for a refused layout or an unreadable config."""
    cfg, where = read_config(model)
    kv = kv_bytes_per_token_of_config(cfg, where=where)
    return prof.model_copy(update={"model": f"{prof.model}; KV size of {where}".lstrip("; "),
                                   "kv_bytes_per_token": Sourced(
        value=kv, source=f"{where}: serving.kv_size (layers x KV heads x head dim x 2 x dtype bytes, or MLA's latent)")})


def run_plan(paths: Sequence[Path], *, profile_path: Path | None, fit_runs: Sequence[str] | None,
             format: str | None, store_root: Path, ttl_s: float, margin_s: float, threshold: int,
             prefill_workers: int, decode_workers: int, routing: str, label: str | None,
             model: Path | None = None, shared_prefix_tokens: int | None = None, queue: bool = True,
             load: Load | None = None) -> str:
    """The whole command (see the module doc); ``load``: the load the traffic is forecast at
    (:mod:`planner.load`; None: the recorded clock, refused for several own-clock trace
    files). Raises ValueError/OSError with a clear message."""
    store = Store(Path(store_root))
    if profile_path is None and not fit_runs:
        raise ValueError("give --profile FILE (data/profiles/*.yaml) or --fit-runs RUN_IDS (fit from recorded runs)")
    prof: CostProfile = load_profile(profile_path) if profile_path else fit_profile(store, fit_runs)
    if model is not None:
        prof = with_model(prof, model)
    traffic, inputs = read_traffic(paths, format, fit_runs)
    loaded = at_load(traffic, [i["format"] for i in inputs], load)
    traffic = loaded.traffic
    if shared_prefix_tokens is None:
        shared_prefix_tokens = runs_shared_prefix_tokens(store, fit_runs)
    settings = PlanSettings(decoder_kv_blocks_ttl_s=ttl_s, handle_ttl_margin_s=margin_s,
                            kv_recompute_threshold=threshold, prefill_workers=prefill_workers,
                            decode_workers=decode_workers, routing=routing, shared_prefix_tokens=shared_prefix_tokens,
                            queue_prefills=queue, queue_decode=queue,
                            # recorded runs at their own clocks were each served alone; drawn sessions share one
                            separate_sources=not loaded.load.drawn and all(i["format"] == RECORDED_RUNS
                                                                           for i in inputs))
    p = plan(traffic, prof, settings)
    p.notes.insert(0, f"load: {loaded.label()}")
    sp = summary.speedups(p)
    fr = pd.concat([summary.frontier(traffic, prof, settings, mode).assign(mode=mode) for mode in BIDIR_MODES],
                   ignore_index=True)
    sessions = pd.concat([summary.defeated_sessions(p, mode).assign(mode=mode) for mode in BIDIR_MODES],
                         ignore_index=True)
    checks = check_runs(store, fit_runs, prof) if fit_runs else None
    plan_id = new_plan_id()
    write_plan(store, p, plan_id=plan_id, label=label, inputs=inputs, speedups=sp, frontiers=fr, sessions=sessions,
               checks=checks)
    return describe(p, sp, fr, sessions, checks) + f"\n\nWritten to {store.root} as plan {plan_id}."
