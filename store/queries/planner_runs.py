"""What the planner (and the conductor's forecasts) read of recorded runs in the store: every query
of the planner's, in one module (the turns to fit on and check against, a run's settings, its
speed probes, the runs a check takes, a run's recording set-up). Each opens a read-only connection
of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import pandas as pd

from core.contract import CACHED_PROBE_TOKENS, COMPUTE_PROBE_TOKENS, PATH_PROBE_TARGET, PROBE_TOKENS
from core.modes import serving_mode
from store.writer import Store


def _marks(values: Sequence) -> str:
    """``?, ?, ...``: one bound parameter per value."""
    return ", ".join("?" for _ in values)


def _frame(store: Store, sql: str, params: Sequence) -> pd.DataFrame:
    """``sql`` with ``params`` on a connection of its own, as a DataFrame."""
    con = store.connect()
    try:
        return con.execute(sql, list(params)).df()
    finally:
        con.close()


#: One row per turn; ``local_tokens`` is NULL where the run did not record the worker's own
#: prefix-cache hit (aggregated serving without ``usage.prompt_tokens_details``).
TURNS_SQL = """
SELECT t.run_id, r.mode, r.history_mode, r.workload, t.session_id, t.turn_index, t.sent_at, t.status, t.ttft_s, t.e2e_s, t.tpot_s,
       t.prompt_tokens,
       t.completion_tokens, t.reuse, coalesce(t.reused_tokens, 0) AS reused_tokens,
       CASE WHEN t.reuse IS NOT NULL THEN coalesce(t.prefill_cached_tokens, 0) ELSE t.cached_tokens
            END AS local_tokens,
       t.expected_reusable_tokens
FROM turns t JOIN runs r USING (run_id)
WHERE t.run_id IN ({ids})
ORDER BY t.run_id, t.session_id, t.turn_index
"""


def recorded_turns(store: Store, run_ids: Sequence[str]) -> pd.DataFrame:
    """The turns of ``run_ids`` with their run's mode (columns of :data:`TURNS_SQL`)."""
    return _frame(store, TURNS_SQL.format(ids=_marks(run_ids)), run_ids)


def run_config_row(store: Store, run_id: str) -> tuple:
    """``(decoder_kv_blocks_ttl_s, handle_ttl_margin_s, prefill_routing, kv_recompute_threshold,
    history_mode, topology)`` of ``run_id`` (views ``run_config`` and ``runs``; the threshold from
    ``runs.config.connector.kv_recompute_threshold``, vLLM's 64 when absent)."""
    con = store.connect()
    try:
        return con.execute(
            "SELECT c.decoder_kv_blocks_ttl_s, c.handle_ttl_margin_s, c.prefill_routing, coalesce(TRY_CAST("
            "json_extract_string(r.config, '$.connector.kv_recompute_threshold') AS INTEGER), 64), r.history_mode, "
            "r.topology FROM run_config c JOIN runs r USING (run_id) WHERE run_id = ?", [run_id]).fetchone()
    finally:
        con.close()


#: A run without probes of its own takes those of the ``turnscope serve`` it was recorded through: the
#: serve's probes (run id ``serve-probes-...``, :class:`turnscope.conductor.speed_probe.ServeProbes`)
#: whose last start probe precedes the run's start and whose first end probe (if any yet) follows its end.
_SERVE_PROBES = """
WITH serve AS (
    SELECT run_id AS serve_id, max(sent_at) FILTER (WHERE phase = 'start') AS last_start,
           min(sent_at) FILTER (WHERE phase = 'end') AS first_end
    FROM run_probes WHERE run_id LIKE 'serve-probes-%' GROUP BY run_id
), pick AS (
    SELECT r.run_id, arg_max(v.serve_id, v.last_start) AS serve_id
    FROM runs r JOIN serve v ON v.last_start <= r.started_at
         AND (v.first_end IS NULL OR v.first_end >= coalesce(r.finished_at, r.started_at))
    WHERE r.run_id IN ({marks}) GROUP BY r.run_id
)
SELECT p.run_id, median(q.ttft_s) FROM pick p JOIN run_probes q ON q.run_id = p.serve_id
WHERE q.status = 'ok' AND q.ttft_s > 0 AND q.prompt_tokens = ? AND (coalesce(q.target, '') = ?) = ?
GROUP BY p.run_id
"""


def _probe_medians(store: Store, run_ids: Sequence[str], tokens: int, path: bool = False) -> dict[str, float]:
    """Run id -> the median TTFT of its ok probes of ``tokens`` prompt tokens, the path probes
    (target :data:`core.contract.PATH_PROBE_TARGET`) when ``path``, else the worker's; a run without
    any takes those of the serve it ran through (:data:`_SERVE_PROBES`)."""
    con = store.connect()
    which = [PATH_PROBE_TARGET.value, path]
    try:
        rows = con.execute(f"SELECT run_id, median(ttft_s) FROM run_probes WHERE status = 'ok' AND ttft_s > 0 "
                           f"AND prompt_tokens = ? AND (coalesce(target, '') = ?) = ? "
                           f"AND run_id IN ({_marks(run_ids)}) GROUP BY run_id",
                           [tokens, *which, *run_ids]).fetchall()
        own = {r for r, _ in rows}
        bare = [r for r in run_ids if r not in own]
        if bare:
            rows += con.execute(_SERVE_PROBES.format(marks=_marks(bare)), [*bare, tokens, *which]).fetchall()
    finally:
        con.close()
    return {r: float(t) for r, t in rows}


def probe_ttft_s(store: Store, run_ids: Sequence[str]) -> dict[str, float]:
    """Run id -> the median TTFT of its ok speed probes (``run_probes`` of
    :data:`core.contract.PROBE_TOKENS` prompt tokens), seconds; runs without one
    are absent."""
    return _probe_medians(store, run_ids, PROBE_TOKENS)


def path_probe_s(store: Store, run_ids: Sequence[str]) -> dict[str, float]:
    """Run id -> the median TTFT of its ok path probes (:data:`core.contract.PATH_PROBE_TARGET`:
    ``PROBE_TOKENS`` prompt tokens through the run's proxy), seconds; runs without one (recorded
    before the path probe, or with no proxy to probe) are absent."""
    return _probe_medians(store, run_ids, PROBE_TOKENS, path=True)


def compute_probe_s(store: Store, run_ids: Sequence[str], short: dict[str, float] | None = None) -> dict[str, float]:
    """Run id -> the median TTFT of its compute probes less that of its short probes
    (:data:`core.contract.COMPUTE_PROBE_TOKENS` and ``PROBE_TOKENS`` prompt
    tokens), seconds: the compute of the tokens between the two lengths on the run's machine; runs
    without both (recorded before the compute probe) are absent. ``short``: :func:`probe_ttft_s` of
    ``run_ids`` when the caller has it already."""
    short = probe_ttft_s(store, run_ids) if short is None else short
    long = _probe_medians(store, run_ids, COMPUTE_PROBE_TOKENS)
    return {r: long[r] - short[r] for r in long if r in short}


def cached_probe_s(store: Store, run_ids: Sequence[str], short: dict[str, float] | None = None) -> dict[str, float]:
    """Run id -> the median TTFT of its cached-prefix probes less that of its short probes
    (:data:`core.contract.CACHED_PROBE_TOKENS`, ``PROBE_TOKENS``), seconds: attention's
    context term on the run's machine, ``a2 x 2^20`` of its c(x), where the probed worker kept its
    prefix cache on (``runs.mode`` aggregated, pd or pd-bidir); other runs, and runs recorded
    before the probe, are absent. ``short``: as :func:`compute_probe_s`."""
    short = probe_ttft_s(store, run_ids) if short is None else short
    cached = _probe_medians(store, run_ids, CACHED_PROBE_TOKENS)
    rows = run_rows(store, [r for r in cached if r in short]) if cached else pd.DataFrame(columns=["run_id", "mode"])
    on = {r.run_id for r in rows.itertuples() if serving_mode(r.mode).prefill_prefix_cache}
    return {r: cached[r] - short[r] for r in cached if r in short and r in on}


class RunProbes(NamedTuple):
    """What a run's probes read, each in seconds, None where the run has none (recorded before that
    probe, or no worker or proxy to probe): :func:`probe_ttft_s` (``short_s``), :func:`compute_probe_s`
    (``compute_s``), :func:`cached_probe_s` (``cached_s``) and :func:`path_probe_s` (``path_s``);
    :func:`planner.fit.on_run_speed` puts a profile on the run's machine with them."""

    short_s: float | None = None
    compute_s: float | None = None
    cached_s: float | None = None
    path_s: float | None = None


def run_probes(store: Store, run_ids: Sequence[str]) -> dict[str, RunProbes]:
    """Run id -> :class:`RunProbes` for every one of ``run_ids`` (all None where it has no probe)."""
    short = probe_ttft_s(store, run_ids)
    compute, cached = compute_probe_s(store, run_ids, short), cached_probe_s(store, run_ids, short)
    path = path_probe_s(store, run_ids)
    return {r: RunProbes(short.get(r), compute.get(r), cached.get(r), path.get(r)) for r in run_ids}


def runs_of(store: Store, modes: Sequence[str]) -> list[str]:
    """The store's runs in one of ``modes`` (``runs.mode``; the planner's: ``planner.profile.MODES``),
    oldest first."""
    con = store.connect(read_only=True)
    try:
        rows = con.execute(f"SELECT run_id FROM runs WHERE mode IN ({_marks(modes)}) "
                           "ORDER BY started_at, run_id", list(modes)).fetchall()
    finally:
        con.close()
    return [r[0] for r in rows]


def run_rows(store: Store, run_ids: Sequence[str]) -> pd.DataFrame:
    """``run_id, mode, history_mode, workload, workload_spec, topology, first_sent`` (its first turn's
    ``sent_at``, or the run's start) of each of ``run_ids`` the store has."""
    return _frame(store, "SELECT r.run_id, r.mode, r.history_mode, r.workload, r.workload_spec, r.topology, "
                  "coalesce((SELECT min(t.sent_at) FROM turns t WHERE t.run_id = r.run_id), r.started_at) "
                  f"AS first_sent FROM runs r WHERE r.run_id IN ({_marks(run_ids)})", run_ids)


def transfer_rows(store: Store, run_ids: Sequence[str]) -> pd.DataFrame:
    """Per run of ``run_ids``: its mode, P's NIXL transfer time and bytes, the tokens P pulled (view
    ``run_kv_transfer``) and the model's KV bytes per token (``run_config``). Columns: mode,
    prefix_tokens (0), xfer_s, xfer_bytes, reused_tokens, kv_bytes_per_token."""
    return _frame(store, "SELECT r.mode, 0 AS prefix_tokens, x.xfer_s, x.xfer_bytes, x.reused_tokens, "
                  "c.kv_bytes_per_token FROM run_kv_transfer x JOIN runs r USING (run_id) "
                  f"JOIN run_config c USING (run_id) WHERE run_id IN ({_marks(run_ids)})", run_ids)


def prefill_args(store: Store, run_ids: Sequence[str]) -> pd.DataFrame:
    """Per run of ``run_ids``: its topology's platform and the prefill role's vLLM arguments (a JSON
    list, or NULL), from ``runs.config.topology``. Columns: platform, args."""
    return _frame(store, f"SELECT json_extract_string(config, '$.topology.platform') AS platform, "
                         f"json_extract(config, '$.topology.roles.prefill.args') AS args FROM runs "
                         f"WHERE run_id IN ({_marks(run_ids)})", list(run_ids))


def provenance(store: Store, run_ids: Sequence[str]) -> tuple[tuple, tuple]:
    """What a profile fitted on ``run_ids`` says of where it came from: ``(workload_spec, first
    started_at, last finished_at)`` of the runs, and ``(min, median, max, count)`` of their ok
    speed probes' TTFT (seconds; NULLs and 0 without probes)."""
    con = store.connect()
    try:
        runs = con.execute(f"SELECT any_value(workload_spec), min(started_at), max(finished_at) FROM runs "
                           f"WHERE run_id IN ({_marks(run_ids)})", list(run_ids)).fetchone()
        spread = con.execute(f"SELECT min(ttft_s), median(ttft_s), max(ttft_s), count(*) FROM run_probes "
                             f"WHERE status = 'ok' AND run_id IN ({_marks(run_ids)})", list(run_ids)).fetchone()
    finally:
        con.close()
    return runs, spread
