"""The serving modes turnscope launches and compares: one :class:`ServingMode` per mode, and every
part asks it (the launcher, the proxy's settings, the planner, the statistics, the dashboard).

A mode is one worker arrangement (docs/design.md): one aggregated
worker with prefix caching, or P/D (prefill and decode workers joined by vLLM's NixlConnector) with
or without bidirectional KV transfer (``bidirectional_kv_xfer``: D keeps a finished request's KV for
the session's next prefill to pull) and with or without P's prefix cache
(``--no-enable-prefix-caching`` on P: the vendor's cache-miss scenario, vLLM blog 2026-10-12).

Adding a mode is one entry of :data:`SERVING_MODES` here, plus how its workers are launched
(``serving.workers.mode_workers``) if its flags are not the three below. A mode's name is written
here only: every other module takes it from the constants below or from :data:`SERVING_MODES`
(checked by ``tests/unit/test_names.py``). This module imports only the contract's roles (both are
the ground layer, docs/design.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from core.contract import Role


@dataclass(frozen=True)
class Baseline:
    """A mode a treatment is compared against: ``mode`` (its name) and ``question`` (what the pair
    answers, shown on the Sweep page). ``measured``: the headline and the sweep compare the pair in
    measured runs; False: only the planner forecasts it."""

    mode: str
    question: str
    measured: bool = True


@dataclass(frozen=True)
class ServingMode:
    """One serving mode.

    ``name``: what the CLI, the store (``runs_log.mode``) and the dashboard call it.
    ``disaggregated``: prefill and decode workers (P/D); False: aggregated workers.
    ``bidirectional``: ``bidirectional_kv_xfer`` on both roles, so D holds KV between a session's
    turns and P can pull it back. ``prefill_prefix_cache``: P's (or the aggregated worker's) own
    prefix cache is on. ``colour``: the mode's colour in every chart (hex ``#rrggbb``).
    ``baselines``: the modes this one is compared against, in the order they are reported.
    """

    name: str
    disaggregated: bool
    bidirectional: bool
    prefill_prefix_cache: bool
    colour: str
    baselines: tuple[Baseline, ...] = ()

    @property
    def roles(self) -> tuple[Role, ...]:
        """The topology roles whose workers this mode runs (``serving.topology.Topology``)."""
        return (Role.PREFILL, Role.DECODE) if self.disaggregated else (Role.AGGREGATED,)

    def prefix_caching(self, role: str) -> bool:
        """Whether a worker of ``role`` runs with prefix caching on (only P's can be off)."""
        return self.prefill_prefix_cache or role != Role.PREFILL


#: The modes' names, for the modules that name one (a mode's name is spelled nowhere else).
AGGREGATED = "aggregated"
PD = "pd"
PD_BIDIR = "pd-bidir"
PD_NOCACHE = "pd-nocache"
PD_BIDIR_NOCACHE = "pd-bidir-nocache"
#: What a run records as its mode when it drives a server turnscope did not launch.
ATTACH_MODE = "attach"
#: The chart colour of runs against an attached server (no mode of :data:`SERVING_MODES`).
ATTACH_COLOUR = "#8c564b"

#: Every serving mode, in display order (the legend's, the CLI's default order of runs).
SERVING_MODES: tuple[ServingMode, ...] = (
    ServingMode(AGGREGATED, disaggregated=False, bidirectional=False, prefill_prefix_cache=True,
                colour="#4c4c4c"),
    ServingMode(PD, disaggregated=True, bidirectional=False, prefill_prefix_cache=True, colour="#1f77b4"),
    ServingMode(PD_BIDIR, disaggregated=True, bidirectional=True, prefill_prefix_cache=True, colour="#2ca02c",
                baselines=(Baseline(PD, "against one-way P/D with P's prefix cache on"),
                           Baseline(AGGREGATED, "against aggregated serving with prefix caching"),
                           Baseline(PD_BIDIR_NOCACHE, "bidirectional transfer with P's cache on against off",
                                    measured=False))),
    ServingMode(PD_NOCACHE, disaggregated=True, bidirectional=False, prefill_prefix_cache=False,
                colour="#ff7f0e"),
    ServingMode(PD_BIDIR_NOCACHE, disaggregated=True, bidirectional=True, prefill_prefix_cache=False,
                colour="#9467bd",
                baselines=(Baseline(PD_NOCACHE, "the vendor's comparison: P's prefix cache off"),)),
)
#: The names of :data:`SERVING_MODES`, in display order.
MODES: tuple[str, ...] = tuple(m.name for m in SERVING_MODES)
_BY_NAME = {m.name: m for m in SERVING_MODES}

#: The P/D mode whose P computes every prompt from scratch (no prefix cache, no pull): the reference
#: prefill cost (the planner's c(x), the Sweep page's ideal).
RECOMPUTE_MODE: str = next(m.name for m in SERVING_MODES
                           if m.disaggregated and not m.bidirectional and not m.prefill_prefix_cache)
#: The modes whose later turns can reuse KV held on the decode worker (bidirectional transfer),
#: in display order.
BIDIRECTIONAL_MODES: tuple[str, ...] = tuple(m.name for m in SERVING_MODES if m.bidirectional)


def serving_mode(name: str) -> ServingMode:
    """The mode called ``name``. Raises ValueError naming the known modes for any other name."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown mode {name!r}; expected one of {', '.join(MODES)}") from None


def one_way(name: str) -> str:
    """The one-way P/D mode (no bidirectional transfer) with the same P's prefix cache as ``name``'s
    (``pd-bidir`` -> ``pd``, ``pd-bidir-nocache`` -> ``pd-nocache``). Raises ValueError if none."""
    m = serving_mode(name)
    for other in SERVING_MODES:
        if other.disaggregated and not other.bidirectional and other.prefill_prefix_cache == m.prefill_prefix_cache:
            return other.name
    raise ValueError(f"no one-way P/D mode with P's prefix cache as in {name!r}")


def ordered(key: Callable[[ServingMode], object], names: Iterable[str] = MODES) -> tuple[str, ...]:
    """``names`` (known modes) sorted by ``key`` of their :class:`ServingMode`, ties in display order."""
    return tuple(sorted(names, key=lambda n: (key(serving_mode(n)), MODES.index(n))))


#: The order of the Sweep page and ``turnscope sweep``: P/D before aggregated, P's cache off before
#: on, one-way before bidirectional (``pd-nocache``, ``pd-bidir-nocache``, ``pd``, ``pd-bidir``, ...).
SWEEP_ORDER: tuple[str, ...] = ordered(lambda m: (not m.disaggregated, m.prefill_prefix_cache, m.bidirectional))
#: The order of the planner's modes: aggregated, one-way P/D, bidirectional P/D.
PLAN_ORDER: tuple[str, ...] = ordered(lambda m: (m.disaggregated, m.bidirectional))
#: The order of the Plan page's tables: as :data:`PLAN_ORDER`, P's cache off before on.
PLAN_TABLE_ORDER: tuple[str, ...] = ordered(lambda m: (m.disaggregated, m.bidirectional, m.prefill_prefix_cache))


def pairs(measured_only: bool = True, order: Iterable[str] = MODES) -> tuple[tuple[str, str, str], ...]:
    """(treatment, baseline, question) of every mode's :attr:`ServingMode.baselines`, treatments in
    ``order``; with ``measured_only`` the pairs the headline and the sweep measure, else the
    planner's too."""
    return tuple((t, b.mode, b.question) for t in order for b in serving_mode(t).baselines
                 if b.measured or not measured_only)
