"""The soak's checks as pure functions (``bench/soak.py`` gathers their inputs; tests/unit/test_soak_checks.py
makes rows go missing or appear twice and sees them fail).

Three counts of the same turns, each well defined:

* **stored**: the run's ``turns`` rows, every status (``ok``, ``error``, ``timeout``, ``cancelled``:
  a request cut off in flight when Locust stopped its users), by ``kind``; each carries the request
  id the load generator sent (``x-request-id``, ``lg-<hex>``);
* **Locust**: its ``POST <kind>`` request events (failures included), read from ``--json-file``,
  which Locust writes after its users stopped (its ``--csv`` files are rewritten once a second and
  not at the end, so they miss the last second's turns);
* **proxy**: the requests the proxy served after the warm-up, one JSON log line each
  (``"event": "request"``, written when the request ends, whatever its status), by request id.

They agree when nothing is lost: stored == Locust per kind (requests and failures), no request id
stored twice, every request the proxy served is a stored row, and every ``ok`` row was served by
the proxy. A stored non-ok row the proxy never logged is a request that never reached it (cut off
before it was sent, or the connection refused): allowed, and counted in the detail.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from serving.canary import CANARY_REQUEST_PREFIX


@dataclass(frozen=True)
class StoredTurn:
    """One ``turns`` row as the rows check needs it."""

    kind: str
    status: str
    request_id: str | None


def locust_posts(json_file: Path) -> dict[str, tuple[int, int]]:
    """Kind -> (requests, failures) of Locust's ``POST <kind>`` entries in its ``--json-file`` output
    (a list of stats entries with ``method``, ``name``, ``num_requests``, ``num_failures``).

    Raises ValueError naming the file when it is not that list."""
    try:
        entries = json.loads(Path(json_file).read_text())
        if not isinstance(entries, list):
            raise TypeError(f"a {type(entries).__name__}, not a list")
        return {e["name"]: (int(e["num_requests"]), int(e["num_failures"])) for e in entries if e["method"] == "POST"}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{json_file}: not Locust's --json-file stats (a list of entries with method, name, "
                         f"num_requests, num_failures): {e}") from e


def proxy_requests(log_lines: Iterable[str]) -> list[tuple[str, str]]:
    """(request id, status) of every ``"event": "request"`` JSON line of the proxy's log (other
    lines skipped, and the known-answer canary's requests: their ids start with
    ``serving.canary.CANARY_REQUEST_PREFIX``; they are no turns of the load)."""
    out = []
    for line in log_lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == "request" and \
                not str(rec.get("request_id")).startswith(CANARY_REQUEST_PREFIX):
            out.append((str(rec.get("request_id")), str(rec.get("status"))))
    return out


def rows_check(stored: Sequence[StoredTurn], locust: dict[str, tuple[int, int]],
               proxy: Sequence[tuple[str, str]]) -> tuple[bool, str]:
    """Whether the three counts agree (module doc), and a line saying exactly what was compared."""
    problems = []
    by_kind = Counter(t.kind for t in stored)
    failed_by_kind = Counter(t.kind for t in stored if t.status != "ok")
    for kind in sorted(set(by_kind) | set(locust)):
        sent, failed = locust.get(kind, (0, 0))
        if (by_kind[kind], failed_by_kind[kind]) != (sent, failed):
            problems.append(f"{kind}: stored {by_kind[kind]} ({failed_by_kind[kind]} not ok) vs Locust {sent} "
                            f"({failed} failed)")
    ids = Counter(t.request_id for t in stored)
    twice = sorted(i for i, n in ids.items() if i is not None and n > 1)
    if twice:
        problems.append(f"{len(twice)} request id(s) stored more than once, e.g. {twice[0]}")
    if ids[None]:
        problems.append(f"{ids[None]} row(s) without a request id")
    served = Counter(i for i, _ in proxy)
    served_twice = sorted(i for i, n in served.items() if n > 1)
    if served_twice:
        problems.append(f"{len(served_twice)} request id(s) logged twice by the proxy, e.g. {served_twice[0]}")
    missing = sorted(set(served) - set(ids))
    if missing:
        problems.append(f"{len(missing)} request(s) the proxy served have no stored row, e.g. {missing[0]}")
    unseen = [t for t in stored if t.request_id not in served]
    unseen_ok = [t for t in unseen if t.status == "ok"]
    if unseen_ok:
        problems.append(f"{len(unseen_ok)} ok row(s) the proxy never served, e.g. {unseen_ok[0].request_id}")
    statuses = Counter(t.status for t in stored)
    detail = (f"stored {len(stored)} turns rows ({', '.join(f'{n} {s}' for s, n in sorted(statuses.items()))}) "
              f"vs Locust's {sum(n for n, _ in locust.values())} POST events ({sum(f for _, f in locust.values())} "
              f"failed), per kind {', '.join(f'{k} {by_kind[k]}/{locust.get(k, (0, 0))[0]}' for k in sorted(set(by_kind) | set(locust)))}; "
              f"the proxy served {len(proxy)} requests after the warm-up, {len(set(served) & set(ids))} of them stored "
              f"(by request id); {len(unseen)} stored request(s) never reached the proxy")
    if problems:
        detail += ". MISMATCH: " + "; ".join(problems)
    return not problems, detail


def flat(values: list[float], rel: float, floor: float) -> tuple[bool, float, float]:
    """(last-quarter median - first-quarter median <= max(rel * first, floor), first, last)."""
    q = max(1, len(values) // 4)
    first, last = statistics.median(values[:q]), statistics.median(values[-q:])
    return last - first <= max(rel * first, floor), first, last


def steady_from_s(warmup_s: float, proxy_ttl_s: float) -> float:
    """When the flatness checks start, seconds after the first turn: after the warm-up and after
    one proxy TTL, when the handle table holds what it will hold at steady state (each handle is
    dropped a TTL after it was stored, so until then it only grows, as it should)."""
    return max(warmup_s, proxy_ttl_s)


def canaries_check(results: Sequence[str]) -> tuple[bool, str]:
    """The known-answer canaries of a soak (``serving.canary``; each ``match``, ``mismatch`` or
    ``error``): pass when none answered wrong tokens and at least one matched (a canary that
    timed out under load is an error, counted, not a wrong answer)."""
    n = Counter(results)
    ok = n["mismatch"] == 0 and n["match"] > 0
    return ok, (f"{len(results)} canaries (start, every few minutes under load, end): {n['match']} matched, "
                f"{n['mismatch']} answered wrong tokens, {n['error']} failed")
