"""The proxy's routing policies (serving/routing.py): stickiness, failover, rebalancing, prefix choice."""

from collections import Counter

import pytest

from serving.proxy import Worker
from serving.routing import Router

W = [Worker(name=f"prefill-{i}", url=f"http://h:{i}") for i in range(3)]


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_round_robin_cycles_whatever_the_session():
    r = Router(W, "round-robin")
    assert [r.pick("s").name for _ in range(6)] == ["prefill-0", "prefill-1", "prefill-2"] * 2


def test_session_is_sticky_and_spreads_sessions():
    r = Router(W, "session")
    first = {f"s{i}": r.pick(f"s{i}").name for i in range(300)}
    assert all(r.pick(s).name == name for s, name in first.items() for _ in range(3))
    counts = Counter(first.values())
    assert len(counts) == 3 and min(counts.values()) > 60  # 100 expected each; a skew this big is a bug


def test_session_failover_moves_only_the_failed_workers_sessions_and_comes_back():
    clock = Clock()
    r = Router(W, "session", cooldown_s=10.0, clock=clock)
    before = {f"s{i}": r.pick(f"s{i}").name for i in range(200)}
    r.mark_failed("prefill-1")
    during = {s: r.pick(s).name for s in before}
    assert "prefill-1" not in during.values()
    assert all(during[s] == before[s] for s in before if before[s] != "prefill-1")  # others stay
    clock.t = 11.0
    assert {s: r.pick(s).name for s in before} == before  # healthy again: back where it was


def test_session_rebalances_when_a_worker_is_added():
    r = Router(W[:2], "session")
    before = {f"s{i}": r.pick(f"s{i}").name for i in range(300)}
    r.add(W[2])
    after = {s: r.pick(s).name for s in before}
    moved = [s for s in before if after[s] != before[s]]
    assert moved and all(after[s] == "prefill-2" for s in moved)  # only moves onto the new worker
    assert 50 < len(moved) < 150  # about a third (100) of the sessions


def test_prefix_aware_picks_the_worker_with_the_longest_known_prefix():
    r = Router(W, "prefix-aware")
    sticky = r.pick("s").name  # nothing known: as `session`
    assert sticky == Router(W, "session").pick("s").name
    other = next(w.name for w in W if w.name != sticky)
    r.served("s", sticky, 1_000)
    r.served("s", other, 5_000)
    assert r.pick("s").name == other
    r.mark_failed(other)
    assert r.pick("s").name == sticky  # the longest prefix on a healthy worker


def test_no_session_goes_round_robin_and_bad_policy_is_refused():
    r = Router(W, "session")
    assert [r.pick(None).name for _ in range(3)] == ["prefill-0", "prefill-1", "prefill-2"]
    with pytest.raises(ValueError, match="routing policy must be one of"):
        Router(W, "random")


def test_round_robin_skips_a_failed_worker_and_tries_all_when_all_failed():
    clock = Clock()
    r = Router(W, "round-robin", cooldown_s=10.0, clock=clock)
    r.mark_failed("prefill-1")
    assert [r.pick("s").name for _ in range(4)] == ["prefill-0", "prefill-2", "prefill-0", "prefill-2"]
    for w in W:
        r.mark_failed(w.name)
    assert {r.pick("s").name for _ in range(3)} == {"prefill-0", "prefill-1", "prefill-2"}  # none left out


def test_prefix_aware_forgets_the_least_recently_served_sessions_beyond_its_bound():
    r = Router(W, "prefix-aware", max_sessions=2)
    hashed = {s: Router(W, "session").pick(s).name for s in ("a", "b", "c")}
    elsewhere = {s: next(w.name for w in W if w.name != hashed[s]) for s in hashed}
    for s in ("a", "b", "c"):
        r.served(s, elsewhere[s], 1_000)
    assert r.pick("a").name == hashed["a"]  # "a" was forgotten: back to the session hash
    assert (r.pick("b").name, r.pick("c").name) == (elsewhere["b"], elsewhere["c"])
