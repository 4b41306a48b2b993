"""The handle table's memory stays bounded by the TTL (what the soak checks over 20 minutes)."""

import pytest

from serving import handles as h


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def params(n: int) -> dict:
    return {"remote_num_tokens": n, "remote_block_ids": [[1, 2]], "remote_engine_id": "D"}


def test_expired_handles_are_dropped_with_their_ids_and_still_read_expired():
    clock = Clock()
    table = h.HandleTable(ttl_s=10.0, clock=clock)
    for i in range(1000):  # one session finishing every 0.1 s, none coming back
        table.take(f"s{i}")
        table.put(f"s{i}", params(4000), "d", list(range(4000)))
        clock.t += 0.1
    # handles stored in the last 10 s: 100 (puts at t = 90.0 .. 99.9; t is now 100.0)
    assert table.held_handles() == len(table.live_handles()) == 100
    kept_ids = sum(len(e.handle.token_ids) for e in table._entries.values() if e.handle is not None)
    markers = sum(e.expired_created_at is not None for e in table._entries.values())
    assert kept_ids == 100 * 4000 and markers == 900  # the expired ones keep a time, not their ids
    assert len(table) == 1000  # small markers remain (bounded by max_sessions), so a late turn reads:
    handle, outcome = table.take("s0")
    assert (handle, outcome) == (None, h.MISS_EXPIRED)
    assert table.age_of_last_taken("s0") == pytest.approx(100.0)  # its age, kept without its ids
    assert table.take("s0") == (None, h.MISS_CONSUMED)
    handle, outcome = table.take("s999")  # stored 0.1 s ago
    assert outcome is None and handle.token_ids.tolist() == list(range(4000))


def test_a_newer_handle_is_not_dropped_by_the_expiry_of_an_older_one():
    clock = Clock()
    table = h.HandleTable(ttl_s=10.0, clock=clock)
    table.take("s")
    table.put("s", params(8), "d", list(range(8)))
    clock.t = 6.0
    table.put("s", params(9), "d", list(range(9)))  # the session's next turn replaced it
    clock.t = 12.0  # the first one expired, the second has 4 s left
    assert table.held_handles() == 1
    handle, outcome = table.take("s")
    assert outcome is None and handle.num_tokens == 9


def test_sessions_are_bounded_by_max_sessions():
    clock = Clock()
    table = h.HandleTable(ttl_s=10.0, max_sessions=50, clock=clock)
    for i in range(200):
        table.take(f"s{i}")
        table.put(f"s{i}", params(4), "d", [1, 2, 3, 4])
    assert len(table) == 50 and table.held_handles() == 50
    assert table.take("s0") == (None, h.MISS_FIRST_TURN)  # forgotten: least recently used first out


def test_a_consumed_handle_is_not_kept_alive_by_the_table():
    import gc
    import weakref

    table = h.HandleTable(ttl_s=10.0, clock=Clock())
    table.take("s")
    table.put("s", params(4), "d", [1, 2, 3, 4])
    handle, outcome = table.take("s")
    ref = weakref.ref(handle)
    del handle
    gc.collect()
    assert outcome is None and ref() is None  # freed once the proxy is done with it
