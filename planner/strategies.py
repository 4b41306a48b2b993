"""The ledger's KV retention strategies (:mod:`planner.ledger`): one :class:`LedgerStrategy`
per strategy, and every part asks it (the ledger, the recommendation, the ``vllm serve`` flags, the
recommended topology, the Plan page's markers and order).

A strategy's name is written here only (checked by ``tests/unit/test_names.py``); ``pd`` and
``pd-bidir`` are named as the modes they are costed as (:mod:`core.modes`). Adding a
strategy is one :class:`Strategy` member and one :data:`LEDGER_STRATEGIES` entry here, plus how the
ledger forecasts it (``planner.ledger.forecast_strategy``) if the mode it is costed as and
its host tier do not say (docs/design.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from core import modes


class Strategy(StrEnum):
    """A ledger strategy's name (equal to its string, as the store's ``plan_ledger.strategy`` holds it)."""

    RECOMPUTE = "recompute"
    PD = modes.PD
    PD_HOST = "pd+host"
    PD_BIDIR = modes.PD_BIDIR
    PD_BIDIR_HOST = "pd-bidir+host"

    def __repr__(self) -> str:
        return repr(self.value)


@dataclass(frozen=True)
class LedgerStrategy:
    """One strategy. ``name``; ``mode``: the planner mode it is costed as (its P's prefix cache and
    D's retention are that mode's); ``host``: P's prefix cache is backed by a host-memory tier
    (vLLM's OffloadingConnector); ``symbol``: its marker on the Plan page (filled for P's GPU cache
    and D, open where the host tier is added; the colour is its mode's)."""

    name: Strategy
    mode: str
    host: bool
    symbol: str

    @property
    def bidirectional(self) -> bool:
        """Whether it holds a finished turn's KV on D (its mode transfers KV both ways)."""
        return modes.serving_mode(self.mode).bidirectional


#: Every strategy, in the ledger's order (its rows, the Plan page's table and chart).
LEDGER_STRATEGIES: tuple[LedgerStrategy, ...] = (
    LedgerStrategy(Strategy.RECOMPUTE, modes.RECOMPUTE_MODE, host=False, symbol="square"),
    LedgerStrategy(Strategy.PD, modes.PD, host=False, symbol="circle"),
    LedgerStrategy(Strategy.PD_HOST, modes.PD, host=True, symbol="circle-open"),
    LedgerStrategy(Strategy.PD_BIDIR, modes.PD_BIDIR, host=False, symbol="diamond"),
    LedgerStrategy(Strategy.PD_BIDIR_HOST, modes.PD_BIDIR, host=True, symbol="diamond-open"),
)

#: Strategy name -> the planner mode it is costed as, in the ledger's order.
STRATEGIES: dict[str, str] = {s.name: s.mode for s in LEDGER_STRATEGIES}
#: The strategies with P's prefix cache backed by the host tier.
HOST_STRATEGIES: tuple[Strategy, ...] = tuple(s.name for s in LEDGER_STRATEGIES if s.host)
#: The strategies that hold a finished turn's KV on D.
BIDIR_STRATEGIES: tuple[Strategy, ...] = tuple(s.name for s in LEDGER_STRATEGIES if s.bidirectional)
#: The strategy every other is measured against (P computes every prompt).
RECOMPUTE: Strategy = Strategy.RECOMPUTE
#: Marker of each strategy on the Plan page.
STRATEGY_SYMBOLS: dict[str, str] = {s.name: s.symbol for s in LEDGER_STRATEGIES}


def holds_memory(strategy: str) -> bool:
    """Whether ``strategy`` holds KV out of other requests' reach: D's pinned turns or the host tier
    (the recommendation and the fleet pick make such a strategy win by a margin)."""
    return strategy in BIDIR_STRATEGIES or strategy in HOST_STRATEGIES


#: A strategy that holds memory (:func:`holds_memory`) must beat the best one without it by more
#: than this fraction of mean TTFT: a gain inside the planner's error (docs/planner/held-out.md)
#: is not worth the memory. The one definition the recommendation and the fleet pick share.
MIN_GAIN = 0.05


def memory_pays(held_mean_s: float, plain_mean_s: float) -> bool:
    """Whether a mean TTFT of ``held_mean_s`` (a strategy that holds memory) beats ``plain_mean_s``
    (the best without) by more than :data:`MIN_GAIN`: ``held < plain x (1 - MIN_GAIN)``, strictly
    (at exactly the margin the simpler one wins). Seconds."""
    return held_mean_s < plain_mean_s * (1 - MIN_GAIN)


def pick_paying_memory(items: list, strategy_of, mean_of, held_of):
    """The item of ``items`` (non-empty) with the lowest mean TTFT (``mean_of``, seconds; ties: the
    least held memory, ``held_of``), unless it holds memory and does not pay for it
    (:func:`memory_pays`) against the best of those that hold none: then that one. The rule of both
    the recommendation (:func:`planner.recommend.choose`) and the fleet pick
    (:func:`planner.fleet.cheapest`)."""
    def key(e):
        return (mean_of(e), held_of(e))

    winner = min(items, key=key)
    plain = [e for e in items if not holds_memory(strategy_of(e))]
    if holds_memory(strategy_of(winner)) and plain:
        simple = min(plain, key=key)
        if not memory_pays(mean_of(winner), mean_of(simple)):
            return simple
    return winner
