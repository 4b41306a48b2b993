"""The facts of the proxy's recent requests, by request id: what its look-up route answers
(:data:`core.contract.REQUEST_FACTS_ROUTE`, a :class:`core.contract.RequestFactsAnswer`).

A client that leaves a request in flight (a load generator stopping, Ctrl-C) leaves before the
proxy's headers and in-band facts reach it (they go out once D answers), yet P may already have
pulled D's blocks for it: vLLM's ``external_kv_transfer`` counter holds those tokens. The client
keeps the request id it sent (:data:`core.contract.REQUEST_ID_HEADER`) and asks for the facts by
it afterwards (``loadgen.facts_lookup``), so the turns still sum to the counter
(docs/schema/queries.md, ``external_kv_vs_proxy``).

Each request is registered when admitted, with the very :class:`~serving.proxy_request.RequestFacts`
object the proxy's steps fill in, so a look-up reads the facts as far as the request got (P's
outcome and pulled tokens once ``SessionProxy.account_prefill`` has run) and whether it has ended.
The table is bounded: the oldest entries are dropped past ``capacity`` (a proxy serves for hours).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from core.contract import FACTS_FIELD, RequestFactsAnswer
from core.modes import AGGREGATED
from serving.proxy_request import RequestFacts

#: Requests kept by default. A client asks within seconds of leaving (``loadgen.facts_lookup``
#: waits about 2 s), so the table must outlast the requests admitted meanwhile: 4,096 holds that
#: much at 2,000 requests a second, far above what a proxy in front of CPU or single-GPU workers
#: serves. Each entry is one small facts object (under 1 KiB): a few MiB in all.
DEFAULT_CAPACITY = 4096

#: The counts that are unknown until P's answer was accounted (P/D modes).
_COUNTS_FROM_P = ("reused_tokens", "prefill_cached_tokens", "recomputed_tokens")


@dataclass
class RecentRequest:
    """One request's entry: its facts (the object the proxy fills in) and how it ended (the proxy's
    log status; None while it runs)."""

    facts: RequestFacts
    status: str | None = None


class RecentRequests:
    """The last ``capacity`` requests' facts by request id, oldest dropped first.

    A request id seen again (a client reusing its ids) names the newer request from then on.

    Raises:
        ValueError: ``capacity`` below 1.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 request, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, RecentRequest] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def admitted(self, facts: RequestFacts) -> None:
        """Register a request as it is admitted (its facts object is read at each look-up)."""
        self._entries.pop(facts.request_id, None)
        self._entries[facts.request_id] = RecentRequest(facts)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def ended(self, facts: RequestFacts, status: str) -> None:
        """The request of ``facts`` ended with the proxy's log ``status`` (first call wins; an
        entry since taken by a newer request of the same id, or dropped, is left alone)."""
        entry = self._entries.get(facts.request_id)
        if entry is not None and entry.facts is facts and entry.status is None:
            entry.status = status

    def answer(self, request_id: str) -> RequestFactsAnswer | None:
        """The look-up route's answer for ``request_id``, or None when it is not kept."""
        entry = self._entries.get(request_id)
        if entry is None:
            return None
        f = entry.facts
        public = dict(f.public())
        if f.mode != AGGREGATED and f.prefill_leg_s is None:  # P's answer never accounted
            public.update(dict.fromkeys(_COUNTS_FROM_P))
        return RequestFactsAnswer(request_id=request_id, ended=entry.status is not None, status=entry.status,
                                  prefill_engine=f.prefill_engine, decode_engine=f.decode_engine,
                                  **{FACTS_FIELD: public})  # type: ignore[typeddict-item]
