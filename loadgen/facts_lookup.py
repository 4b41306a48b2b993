"""Asking the proxy, by request id, for the facts of a request its client left in flight.

When the load generator stops with a request in flight (Locust's run time ending, Ctrl-C,
SIGTERM), the client leaves before the proxy's headers and in-band facts reach it, yet P may
already have pulled D's blocks for the request. The session player then asks the proxy's look-up
route (:data:`core.contract.REQUEST_FACTS_ROUTE`) for the request's facts by the id it sent
(:data:`core.contract.REQUEST_ID_HEADER`), so the ``cancelled`` row carries the reuse outcome and
the pulled tokens and the turns still sum to vLLM's ``external_kv_transfer`` counter
(docs/schema/queries.md, ``external_kv_vs_proxy``). A server that is not turnscope's proxy answers
404: the row stays without facts, as it was before.

The wait is short and bounded (:data:`WAIT_S`): the proxy sees the client's close within
milliseconds (``serving.client_disconnect``) and marks the request ended; Locust stops users by
killing their greenlets and, without ``--stop-timeout``, waits for each to end however long it
takes (``locust/runners.py``: ``stop_users`` -> ``User.stop(force=True)`` -> ``Group.killone``,
blocking), so the look-up must end by itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import httpx

from core.contract import RequestFactsAnswer, request_facts_path

log = logging.getLogger(__name__)

#: Seconds the look-up waits for the proxy to mark the request ended (it then answers the facts
#: as they are: P's outcome and pulled tokens are final once P has answered).
WAIT_S = 2.0
#: Seconds between two asks while the request has not ended.
POLL_S = 0.05


def lookup_request_facts(client: httpx.Client, base_url: str, request_id: str, *, wait_s: float = WAIT_S,
                         poll_s: float = POLL_S, sleep: Callable[[float], None] | None = None,
                         ) -> RequestFactsAnswer | None:
    """The proxy's :class:`core.contract.RequestFactsAnswer` for ``request_id``: asked every
    ``poll_s`` seconds until it says ``ended`` or ``wait_s`` seconds have passed (then the last
    answer, not ended). Each ask may take at most what is left of ``wait_s`` (at least 0.2 s).

    Args:
        client: a sync httpx client (the player's, with the proxy's API key if any).
        base_url: the server's root, e.g. ``http://127.0.0.1:8000``.
        request_id: the id the request was sent with.
        sleep: the sleep between asks (default ``time.sleep``, looked up at call time so that
            gevent's patch applies).

    Returns:
        The answer, or None when the server does not know the request or has no such route
        (404), or answered anything else that is not the answer (logged with the reason).

    Raises:
        Nothing for server or network misbehaviour.
    """
    sleep = sleep or time.sleep
    url = base_url.rstrip("/") + request_facts_path(request_id)
    deadline = time.monotonic() + wait_s
    last: RequestFactsAnswer | None = None
    while True:
        try:
            r = client.get(url, timeout=max(deadline - time.monotonic(), 0.2))
        except httpx.HTTPError as exc:
            log.warning("facts of request %s: %s: %s", request_id, type(exc).__name__, exc)
            return last
        if r.status_code == 404:
            return last
        try:
            answer = r.json() if r.status_code == 200 else None
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or not isinstance(answer.get("ended"), bool):
            log.warning("facts of request %s: %s answered HTTP %s, not the proxy's facts: %.200s", request_id, url,
                        r.status_code, r.text)
            return last
        last = answer  # type: ignore[assignment]
        if answer["ended"] or time.monotonic() + poll_s > deadline:
            return last
        sleep(poll_s)
