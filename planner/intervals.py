"""Forecast intervals from held-out errors (docs/planner/held-out.md).

A profile checked on runs it was not fitted on (``turnscope plan-check``) carries
:class:`planner.profile.HeldOutErrors`: per mode the 10th and 90th percentiles of
measured / forecast TTFT and of recorded minus forecast hit rate. An interval is the forecast moved
by those percentiles; a profile without held-out errors gives NaN ends, shown as "no held-out
interval" (never an invented one).

* TTFT x of mode m: ``[x r10(m), x r90(m)]``;
* speed-up s = baseline / treatment: ``[s r10(b) / r90(t), s r90(b) / r10(t)]`` (the baseline's
  and treatment's errors taken as independent, each at its own extreme: conservative);
* hit rate h: ``[h + e10(m), h + e90(m)]`` clipped to 0..1 (the share of D hits, as the held-out
  check measures it); the ledger's reuse rate (any token reused, P's cache or D's) moves only as far
  as D's reads can move it (:func:`reuse_rate_interval`);
* TTFT saved d = b - t (baseline minus treatment TTFT, seconds): ``[b r10(b) - t r90(t), b r90(b) -
  t r10(t)]`` (each side at its own extreme, as the speed-up);
* GiB-seconds pinned on D, G (:func:`pinned_gib_s_interval`): the hit-rate error moved into handles
  read or not read. A handle D pins is freed when P reads it (at its age a) or else when D's TTL
  passes, so each handle read that the forecast did not read frees b (d_ttl - a) GiB-s, and each
  read handle that is not read holds that much more (b its GiB, the per-handle figure: an upper
  bound where handles share blocks). With L later requests, e x L handles change side, at most the
  handles there are to change: ``G(e) = max(0, G - n(e) s)`` with ``n(e) = max(e L, -hits) x
  s_read`` for e < 0 and ``min(e L, unread) x s_unread`` for e > 0 (``s``: the mean b (d_ttl - a)
  of the read, resp. taken but unread, handles); the interval is ``[G(e90), G(e10)]``.

Every function returns ``(low, high)``; NaN ends where the profile has no held-out errors for the
mode(s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core import modes
from planner.profile import CostProfile

NONE = (math.nan, math.nan)
#: Why a figure has no interval although the profile has held-out errors, per kind of figure.
NOT_CHECKED = {
    "host": "no held-out interval: no host-tier run was ever checked (vLLM's OffloadingConnector is GPU-only)",
    "p_cache": ("no held-out interval: P's cache and host memory follow the traffic's prompts and the LRU's "
                "space, which no held-out check measures"),
}


def _ratio(profile: CostProfile, mode: str) -> tuple[float, float] | None:
    return profile.held_out.ttft_ratio.get(mode) if profile.held_out else None


def ttft_interval(profile: CostProfile, mode: str, ttft_s: float) -> tuple[float, float]:
    """The 80% interval of a forecast TTFT (seconds) of ``mode``."""
    r = _ratio(profile, mode)
    return NONE if r is None or math.isnan(ttft_s) else (ttft_s * r[0], ttft_s * r[1])


def speedup_interval(profile: CostProfile, treatment: str, baseline: str, speedup: float) -> tuple[float, float]:
    """The interval of a forecast speed-up (baseline / treatment TTFT, dimensionless)."""
    rt, rb = _ratio(profile, treatment), _ratio(profile, baseline)
    if rt is None or rb is None or math.isnan(speedup):
        return NONE
    return speedup * rb[0] / rt[1], speedup * rb[1] / rt[0]


def hit_rate_interval(profile: CostProfile, mode: str, hit_rate: float) -> tuple[float, float]:
    """The interval of a forecast hit rate (share, 0..1) of ``mode``."""
    e = profile.held_out.hit_rate_error.get(mode) if profile.held_out else None
    if e is None or math.isnan(hit_rate):
        return NONE
    return min(1.0, max(0.0, hit_rate + e[0])), min(1.0, max(0.0, hit_rate + e[1]))


def no_interval_reason(profile: CostProfile, mode: str, what: str = "ttft") -> str | None:
    """Why a figure of ``mode`` has no held-out interval (``what``: ``ttft`` or ``hit_rate``), or
    None when it has one."""
    if profile.held_out is None:
        return (f"no held-out interval: profile {profile.name} was never checked on runs it was not fitted on "
                "(`turnscope plan-check ... --write-profile`)")
    if what == "hit_rate" and mode not in profile.held_out.hit_rate_error:
        return f"no held-out interval: the held-out check measured no hit rate of mode {mode} (D hits only)"
    if what == "ttft" and mode not in profile.held_out.ttft_ratio:
        return f"no held-out interval: the held-out check had no {mode} run"
    return None


def ttft_saved_interval(profile: CostProfile, treatment: str, baseline: str, baseline_s: float,
                        treatment_s: float) -> tuple[float, float]:
    """The interval of a forecast TTFT saved, ``baseline_s - treatment_s`` (seconds)."""
    rt, rb = _ratio(profile, treatment), _ratio(profile, baseline)
    if rt is None or rb is None or math.isnan(baseline_s) or math.isnan(treatment_s):
        return NONE
    return baseline_s * rb[0] - treatment_s * rt[1], baseline_s * rb[1] - treatment_s * rt[0]


@dataclass(frozen=True)
class HandleReads:
    """What D's pinned GiB-seconds depend on, from one forecast of a bidirectional mode:
    ``later_requests`` (L), ``hits`` (handles read), ``unread`` (handles taken by the proxy but not
    read: below the threshold, a mismatch, a declined read), ``s_read_gib_s`` and
    ``s_unread_gib_s``: the mean per handle of b (d_ttl - a) (GiB-s; b the handle's GiB, a its age
    when taken, d_ttl D's TTL) over the read and the unread handles (0 where there are none);
    ``d_only``: later requests whose reuse came from D alone (P's own cache found nothing), the
    ones whose reuse a lost read takes away."""

    later_requests: int
    hits: int
    unread: int
    s_read_gib_s: float
    s_unread_gib_s: float
    d_only: int = 0


def reuse_rate_interval(profile: CostProfile, mode: str, rate: float, reads: HandleReads) -> tuple[float, float]:
    """The interval of a forecast reuse rate (share of later requests reusing any token, P's cache or
    D's, 0..1) of a bidirectional ``mode``: the D-hit error e moved onto it, at most what D's reads
    can change: ``r + max(e, -d_only / L)`` for e < 0 (a lost read takes reuse away only from a
    request that had no other), ``r + min(e, unread / L)`` for e > 0 (a gained read can only be a
    handle taken but not read); ``[r(e10), r(e90)]`` clipped to 0..1."""
    e = profile.held_out.hit_rate_error.get(mode) if profile.held_out else None
    if e is None or math.isnan(rate) or reads.later_requests == 0:
        return NONE
    n = reads.later_requests

    def at(err: float) -> float:
        moved = max(err, -reads.d_only / n) if err < 0 else min(err, reads.unread / n)
        return min(1.0, max(0.0, rate + moved))

    return at(e[0]), at(e[1])


def pinned_gib_s_interval(profile: CostProfile, mode: str, gib_s: float, reads: HandleReads) -> tuple[float, float]:
    """The interval of D's pinned GiB-seconds ``gib_s`` of ``mode`` (see the module doc)."""
    e = profile.held_out.hit_rate_error.get(mode) if profile.held_out else None
    if e is None or math.isnan(gib_s):
        return NONE

    def at(err: float) -> float:
        n = err * reads.later_requests
        moved = max(n, -reads.hits) * reads.s_read_gib_s if n < 0 else min(n, reads.unread) * reads.s_unread_gib_s
        return max(0.0, gib_s - moved)

    return at(e[1]), at(e[0])


def source_line(profile: CostProfile) -> str:
    """Where a forecast's intervals come from, or that there are none and why."""
    if profile.held_out is None:
        return intervals_none(profile)
    held = profile.held_out
    return (f"80%, from the held-out errors stored with profile {profile.name} ({held.split}; {held.runs} runs, "
            f"{held.turns:,} turns)")


def intervals_none(profile: CostProfile) -> str:
    """The reason a profile gives no interval at all."""
    return no_interval_reason(profile, modes.PD) or ""
