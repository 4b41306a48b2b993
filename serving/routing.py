"""Which worker of a role (prefill or decode) serves a request: the proxy's routing policies.

:data:`ROUTING_POLICIES` (docs/configuration.md):

* ``round-robin``: workers in turn, whatever the session (vLLM's reference P/D proxies);
* ``session``: a session's requests go to the same worker while it is healthy, chosen by
  rendezvous (highest-random-weight) hashing of the session key over the healthy workers, so a
  worker added or failed moves only the sessions that hash to it (Thaler & Ravishankar, "Using
  name-based mappings to increase hit rates", IEEE/ACM ToN 1998). A request without a session
  key goes round-robin;
* ``prefix-aware``: the healthy worker holding the longest cached prefix of this session as far
  as the proxy knows (the prompt tokens it last served for it, :meth:`Router.served`); with no
  such worker, as ``session``.

A worker is marked failed (:meth:`Router.mark_failed`) when the proxy cannot reach it and is
skipped for ``cooldown_s`` seconds; when every worker is failed all are tried.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from core.contract import PREFIX_AWARE, ROUND_ROBIN, ROUTING_POLICIES


def rendezvous_weight(session: str, worker: str) -> int:
    """The session's weight for a worker (the highest wins): 8 bytes of BLAKE2b of both names."""
    return int.from_bytes(hashlib.blake2b(f"{session}\0{worker}".encode(), digest_size=8).digest(), "big")


class Router:
    """Picks one of ``workers`` (objects with a ``name``) per request under ``policy``.

    Args:
        workers: the role's workers, in configuration order.
        policy: one of :data:`ROUTING_POLICIES`.
        cooldown_s: seconds a failed worker is skipped.
        max_sessions: sessions whose served prefixes are remembered (least recently used out).
        clock: monotonic seconds (tests inject one).

    Raises:
        ValueError: no workers, or an unknown policy.
    """

    def __init__(self, workers: Sequence, policy: str = ROUND_ROBIN, cooldown_s: float = 10.0,
                 max_sessions: int = 100_000, clock: Callable[[], float] = time.monotonic):
        if not workers:
            raise ValueError("a router needs at least one worker")
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(ROUTING_POLICIES)}, got {policy!r}")
        self.workers = list(workers)
        self.policy = policy
        self.cooldown_s = cooldown_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._cycle = itertools.cycle(range(len(self.workers)))
        self._failed_until: dict[str, float] = {}
        self._served: OrderedDict[str, dict[str, int]] = OrderedDict()

    def add(self, worker) -> None:
        """A worker joins the role (``session`` moves only the sessions that now hash to it)."""
        self.workers.append(worker)
        self._cycle = itertools.cycle(range(len(self.workers)))

    def mark_failed(self, name: str) -> None:
        """The proxy could not reach worker ``name``: skip it for ``cooldown_s`` seconds."""
        self._failed_until[name] = self._clock() + self.cooldown_s

    def healthy(self) -> list:
        """Workers not in their failure cooldown (all of them when every one is)."""
        now = self._clock()
        alive = [w for w in self.workers if self._failed_until.get(w.name, 0.0) <= now]
        return alive or list(self.workers)

    def served(self, session: str | None, name: str, prompt_tokens: int) -> None:
        """Worker ``name`` computed ``prompt_tokens`` of the session's prompt (its cache may hold them)."""
        if not session:
            return
        entry = self._served.setdefault(session, {})
        entry[name] = prompt_tokens
        self._served.move_to_end(session)
        while len(self._served) > self.max_sessions:
            self._served.popitem(last=False)

    def named(self, name: str):
        """The worker called ``name`` (healthy or not: the caller asked for it), or None."""
        return next((w for w in self.workers if w.name == name), None)

    def pick(self, session: str | None):
        """The worker for a request of ``session`` (None: no session key)."""
        alive = self.healthy()
        if self.policy == ROUND_ROBIN or not session:
            for _ in range(len(self.workers)):
                w = self.workers[next(self._cycle)]
                if w in alive:
                    return w
            return alive[0]
        if self.policy == PREFIX_AWARE:
            known = self._served.get(session) or {}
            best = max(alive, key=lambda w: known.get(w.name, 0))
            if known.get(best.name, 0) > 0:
                return best
        return max(alive, key=lambda w: rendezvous_weight(session, w.name))
