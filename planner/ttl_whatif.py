"""Recorded runs' handles replayed at other ``decoder_kv_blocks_ttl`` values, with D's KV space as
a limit: the Memory page's TTL what-if (docs/dashboard.md: Memory).

The handle lifecycle is the planner's (:class:`planner.pinned_kv.HandleLedger`: pinned
when a turn ends, freed by the session's next turn or at D's TTL, lost when it does not fit
next to the handles already pinned); what this module adds is which turns would pull, decided from
the run's own record rather than forecast:

* a later turn (``turn_index`` >= 1, not ``fresh``) whose recorded outcome was ``hit`` or
  ``miss_expired`` (or none) pulls at TTL ``T`` when it finds its session's handle pinned and
  younger than ``T`` minus the run's handle margin (:func:`core.reuse_rules.handle_expired`;
  P's own 5 s margin: :func:`~core.reuse_rules.p_declines_read`); a recorded miss of another
  kind (mismatch, below the recompute threshold, failed transfer, no handle) does not depend on
  the TTL and stays a miss;
* the turn frees the handle it took at its send time when the proxy would offer it at ``T``
  (younger than ``T`` minus the margin) and its outcome at ``T`` is one after which D frees it
  (:func:`core.reuse_rules.d_frees_taken_handle`: a pull, or a recorded
  ``miss_below_threshold``, after which P tells D it needs none of it); otherwise D keeps it to
  ``T``;
* after each ``ok`` turn D pins ``remote_num_tokens`` = prompt + output - 1 tokens
  (:func:`core.reuse_rules.handle_kv_tokens`) in whole KV blocks of the run's block size (D
  allocates blocks; its space is ``num_gpu_blocks`` of them), times the run's KV bytes per token;
* each run is replayed alone, on its own clock (``sent_at``; a turn ends at ``sent_at + e2e_s``):
  first with no limit (:func:`replay_unlimited`: with nothing lost each hold is known from the
  turns alone, so the replay is a few array operations, fast enough for a page over millions of
  turns), which gives the KV the TTL would ask of D (``demand_peak_bytes``); where that peak
  exceeds D's space (``capacity_bytes``), the handle ledger replays the run turn by turn within it
  (:func:`replay_run`). Without a binding limit the two are the same replay (tested).

Inputs are plain frames (:mod:`planner.recorded_whatif` reads them with the store's queries), so
this module imports neither the store nor the serving or load-generation code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from core import reuse_rules as rules
from core.contract import HIT, MISS_EXPIRED
from planner.pinned_kv import LOST, Handle, HandleLedger, interval_load

#: Recorded outcomes the TTL decides; any other recorded miss stays a miss at every TTL.
TTL_OUTCOMES = (HIT, MISS_EXPIRED)
#: Columns :func:`replay_run` needs, one row per turn.
TURN_COLUMNS = ("session_id", "turn_index", "kind", "status", "sent_s", "e2e_s", "prompt_tokens",
                "completion_tokens", "reuse")
#: Columns of :func:`whatif_ttl_limited`'s result.
RESULT_COLUMNS = ("run_id", "ttl_s", "later_turns", "hits", "lost_hits", "lost_handles", "held_gib_s",
                  "peak_held_bytes", "demand_peak_bytes", "capacity_bytes")


@dataclass(frozen=True)
class RunKV:
    """What one run's D looks like: ``handle_ttl_margin_s`` (s), ``kv_bytes_per_token`` (bytes),
    ``block_size`` (tokens; None: unknown, handles counted in tokens), ``capacity_bytes`` (D's KV
    space, bytes; None: unknown, no limit)."""

    handle_ttl_margin_s: float
    kv_bytes_per_token: float
    block_size: int | None
    capacity_bytes: float | None


@dataclass(frozen=True)
class Replay:
    """One run at one TTL: ``later_turns`` and ``hits`` (turns), ``lost_hits`` (turns that would
    have pulled but their handle did not fit on D), ``lost_handles``, ``held_gib_s`` (GiB x s),
    ``peak_held_bytes`` (bytes, within the limit)."""

    later_turns: int
    hits: int
    lost_hits: int
    lost_handles: int
    held_gib_s: float
    peak_held_bytes: float


def handle_bytes(prompt_tokens: int | np.ndarray, completion_tokens: int | np.ndarray, kv: RunKV) -> float | np.ndarray:
    """Bytes D pins after an ok turn: whole blocks of ``remote_num_tokens`` x KV bytes per token
    (elementwise on integer arrays: a float array)."""
    tokens = rules.handle_kv_tokens(prompt_tokens, completion_tokens)
    if kv.block_size:
        tokens = rules.blocks_of(tokens, kv.block_size) * kv.block_size
    if isinstance(tokens, np.ndarray):
        return tokens.astype(float) * kv.kv_bytes_per_token
    return float(tokens * kv.kv_bytes_per_token)


def replay_run(turns: pd.DataFrame, ttl_s: float, kv: RunKV, capacity_bytes: float | None) -> Replay:
    """Replay one run's ``turns`` (:data:`TURN_COLUMNS`; ``sent_s`` epoch seconds) at D's TTL
    ``ttl_s`` against ``capacity_bytes`` of D's KV space (None: unbounded). See the module doc."""
    t = turns.sort_values(["sent_s", "session_id", "turn_index"], kind="stable")
    proxy_ttl = ttl_s - kv.handle_ttl_margin_s
    ledger = HandleLedger(capacity_bytes, ttl_s)
    t0 = float(t["sent_s"].min()) if len(t) else 0.0
    later = hits = lost_hits = 0
    cols = [t[c].to_numpy() for c in TURN_COLUMNS]
    for i, (session, index, kind, status, sent, e2e, prompt, completion, reuse) in enumerate(zip(*cols, strict=True)):
        now = float(sent) - t0
        taken = ledger.take(now, session)
        if index >= 1 and kind != "fresh":
            later += 1
            decided_by_ttl = pd.isna(reuse) or reuse in TTL_OUTCOMES
            if isinstance(taken, Handle):
                age = now - taken.created_s
                offered = not rules.handle_expired(age, proxy_ttl)
                if decided_by_ttl:
                    outcome = HIT if offered and not rules.p_declines_read(age, ttl_s) else None
                else:
                    outcome = reuse if offered else None   # the recorded miss, given the handle
                if outcome == HIT:
                    hits += 1
                if rules.d_frees_taken_handle(outcome):
                    ledger.read(now, taken)
            elif decided_by_ttl and taken is LOST:
                lost_hits += 1
        if status == "ok":
            p = 0 if pd.isna(prompt) else int(prompt)
            c = 0 if pd.isna(completion) else int(completion)
            end = now + (0.0 if pd.isna(e2e) else float(e2e))
            ledger.finished(end, i, session, rules.handle_kv_tokens(p, c), handle_bytes(p, c, kv))
    ledger.close()
    return Replay(later, hits, lost_hits, ledger.lost_handles, ledger.kv.held_gib_s(), ledger.kv.peak_bytes())


class RunTurns:
    """One run's turns as arrays in replay order (by send time, session, turn index), with what
    every TTL's replay shares: send and end times (s, on the run's clock), ok, the bytes D pins
    after each turn, whether a turn is a later one, whether the TTL decides it, whether D frees the
    handle it takes when its recorded outcome stands (:func:`core.reuse_rules.d_frees_taken_handle`),
    and the index of the session's previous turn (-1: none)."""

    def __init__(self, turns: pd.DataFrame, kv: RunKV):
        t = turns.sort_values(["sent_s", "session_id", "turn_index"], kind="stable").reset_index(drop=True)
        self.frame = t
        sent = t["sent_s"].to_numpy(float)
        self.sent = sent - (sent.min() if len(sent) else 0.0)
        self.end = self.sent + t["e2e_s"].fillna(0.0).to_numpy(float)
        self.ok = (t["status"] == "ok").to_numpy()
        prompt = t["prompt_tokens"].fillna(0).astype("int64").to_numpy()
        completion = t["completion_tokens"].fillna(0).astype("int64").to_numpy()
        self.nbytes = handle_bytes(prompt, completion, kv)
        self.later = ((t["turn_index"] >= 1) & (t["kind"] != "fresh")).to_numpy()
        self.decided_by_ttl = (t["reuse"].isna() | t["reuse"].isin(TTL_OUTCOMES)).to_numpy()
        self.recorded_frees = t["reuse"].map(rules.d_frees_taken_handle).to_numpy(bool)
        previous = t.assign(_i=np.arange(len(t))).groupby("session_id", sort=False)["_i"].shift(1)
        self.prev = previous.fillna(-1).astype("int64").to_numpy()
        has_prev = self.prev >= 0
        #: every request sent after its session's previous one ended (as the session player sends
        #: them); otherwise a session's next request may take an older handle, which only the
        #: ledger replays
        self.sequential = not bool(np.any(has_prev & (self.sent < self.end[np.where(has_prev, self.prev, 0)])))


def replay_unlimited(rt: RunTurns, ttl_s: float, kv: RunKV) -> Replay:
    """The replay with no limit on D's space (what :func:`replay_run` gives with
    ``capacity_bytes=None``), from arrays: a later turn the TTL decides hits when its session's
    previous turn was ok, had ended by the time it was sent, and its handle is younger than the
    proxy's TTL (and P would still read it); each ok turn's handle is held from its end to the
    next turn's send when that one frees it (a hit, or a recorded below-threshold miss given the
    handle: :func:`core.reuse_rules.d_frees_taken_handle`), else for ``ttl_s``. For sessions
    whose requests do not overlap (``rt.sequential``); :func:`whatif_ttl_limited` replays other
    runs with the ledger."""
    proxy_ttl = ttl_s - kv.handle_ttl_margin_s
    has_prev = rt.prev >= 0
    p = np.where(has_prev, rt.prev, 0)
    age = rt.sent - rt.end[p]
    usable = has_prev & rt.ok[p] & (age >= 0)
    offered = rt.later & usable & ~rules.handle_expired(age, proxy_ttl)
    hit = offered & rt.decided_by_ttl & ~rules.p_declines_read(age, ttl_s)
    # replay_run's rule on arrays: a hit frees (d_frees_taken_handle(HIT)), else the recorded miss
    frees = hit | (offered & ~rt.decided_by_ttl & rt.recorded_frees)
    release = rt.end + ttl_s
    release[p[frees]] = rt.sent[frees]
    held = rt.ok
    peak, gib_s = interval_load(rt.end[held], release[held], rt.nbytes[held])
    return Replay(int(rt.later.sum()), int(hit.sum()), 0, 0, gib_s, peak)


def whatif_ttl_limited(turns: pd.DataFrame, runs: dict[str, RunKV], ttls_s: Sequence[float]) -> pd.DataFrame:
    """Every run of ``runs`` replayed at every TTL of ``ttls_s`` (seconds) within its D's KV space.

    ``turns``: :data:`TURN_COLUMNS` plus ``run_id``. Returns one row per (run, TTL) with
    :data:`RESULT_COLUMNS`: later_turns, hits, lost_hits (would have pulled, handle lost to a full
    D), lost_handles, held_gib_s (GiB x s, within the limit), peak_held_bytes (within the limit),
    demand_peak_bytes (the peak with no limit: what the TTL asks of D), capacity_bytes (NaN:
    unknown, no limit)."""
    rows = []
    for run_id, kv in runs.items():
        frame = turns[turns["run_id"] == run_id]
        rt = RunTurns(frame, kv)
        for ttl in sorted({float(x) for x in ttls_s}):
            if ttl <= kv.handle_ttl_margin_s:
                continue  # the proxy would offer no handle at all
            demand = replay_unlimited(rt, ttl, kv) if rt.sequential else replay_run(rt.frame, ttl, kv, None)
            binds = kv.capacity_bytes is not None and demand.peak_held_bytes > kv.capacity_bytes
            limited = replay_run(rt.frame, ttl, kv, kv.capacity_bytes) if binds else demand
            rows.append({"run_id": run_id, "ttl_s": ttl, "later_turns": limited.later_turns, "hits": limited.hits,
                         "lost_hits": limited.lost_hits, "lost_handles": limited.lost_handles,
                         "held_gib_s": limited.held_gib_s, "peak_held_bytes": limited.peak_held_bytes,
                         "demand_peak_bytes": demand.peak_held_bytes,
                         "capacity_bytes": np.nan if kv.capacity_bytes is None else float(kv.capacity_bytes)})
    return pd.DataFrame(rows, columns=list(RESULT_COLUMNS))
