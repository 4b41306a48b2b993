"""Pure logic of the handle table, handle trimming and the prefill outcome rule (hand-computed)."""

import pytest

from serving import handles as h
from serving.proxy import classify_prefill, split_prefill


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def handle(n_prompt=300, n_gen=20, groups=1):
    ids = list(range(1000, 1000 + n_prompt + n_gen))
    params = {"remote_num_tokens": n_prompt + n_gen - 1, "remote_block_ids": [list(range(3)) for _ in range(groups)],
              "remote_engine_id": "D"}
    return h.Handle(params=params, decode_engine="d", token_ids=ids, num_tokens=n_prompt + n_gen - 1,
                    created_at=0, expires_at=10)


def test_fit_whole_handle_when_the_new_prompt_extends_it():
    hd = handle()
    new = hd.token_ids + [7, 8, 9]  # prompt + all generated ids + new turn
    fit = h.fit_handle(hd, new, block_size=128)
    assert fit.params == hd.params and fit.usable_tokens == 319 and fit.divergence_position is None


def test_fit_trims_to_whole_blocks_before_the_divergence_in_every_group():
    hd = handle(groups=2)
    new = hd.token_ids[:305] + [1, 2, 3]  # diverges at 305: two whole blocks of 128 before it
    fit = h.fit_handle(hd, new, block_size=128)
    assert fit.divergence_position == 305 and fit.usable_tokens == 256
    assert fit.params["remote_num_tokens"] == 256 and fit.params["remote_block_ids"] == [[0, 1], [0, 1]]
    assert hd.params["remote_num_tokens"] == 319  # the stored handle is not modified


def test_fit_gives_nothing_when_no_whole_block_precedes_the_divergence():
    hd = handle()
    fit = h.fit_handle(hd, hd.token_ids[:127] + [0], block_size=128)
    assert fit.params is None and fit.divergence_position == 127
    with pytest.raises(ValueError, match="block_size"):
        h.fit_handle(hd, [], block_size=0)


def test_table_outcomes_single_use_and_expiry():
    clock = Clock()
    table = h.HandleTable(ttl_s=50, clock=clock)
    assert table.take("s") == (None, h.MISS_FIRST_TURN)
    table.put("s", {"remote_num_tokens": 10, "remote_block_ids": [[1]]}, "d", list(range(11)))
    assert len(table.live_handles()) == 1
    got, outcome = table.take("s")
    assert got is not None and outcome is None and got.num_tokens == 10
    assert table.take("s") == (None, h.MISS_CONSUMED)  # single use
    table.put("s", {"remote_num_tokens": 10}, "d", [])
    clock.t += 50
    assert table.take("s") == (None, h.MISS_EXPIRED)
    assert table.age_of_last_taken("s") == 50
    table.mark_no_handle("s")
    assert table.take("s") == (None, h.MISS_NO_HANDLE_RETURNED)
    with pytest.raises(ValueError, match="TTL must be positive"):
        h.HandleTable(ttl_s=0)


def test_table_stays_bounded():
    table = h.HandleTable(ttl_s=50, max_sessions=3)
    for i in range(10):
        table.put(f"s{i}", {"remote_num_tokens": 1}, "d", [1, 2])
    assert len(table) == 3
    assert table.take("s0") == (None, h.MISS_FIRST_TURN)  # forgotten: it is new again


@pytest.mark.parametrize("offered, prompt, cached, local, expected", [
    (1031, 1181, 1031, 896, (h.HIT, 135)),                 # pulled 1031 - 896
    (1031, 1181, 1030, 896, (h.HIT, 134)),                 # the scheduler recomputed the last token
    (551, 700, 512, 512, (h.MISS_BELOW_THRESHOLD, 0)),     # 551 - 512 = 39 < 64: recomputed
    (731, 900, 640, 640, (h.MISS_TRANSFER_FAILED, 0)),     # 91 >= 64 should have been pulled: declined
    (896, 1100, 896, 896, (h.MISS_BELOW_THRESHOLD, 0)),    # P's own cache covers the whole handle
    (723, 784, 768, 640, (h.MISS_BELOW_THRESHOLD, 0)),     # 768 > 723: a concurrent duplicate warmed P
    (723, 784, 723, 640, (h.HIT, 83)),                     # the same handle pulled: 723 - 640
    (500, 700, None, 0, (h.MISS_TRANSFER_FAILED, 0)),      # P reported nothing
])
def test_classify_prefill(offered, prompt, cached, local, expected):
    assert classify_prefill(offered, prompt, cached, local, threshold=64) == expected


@pytest.mark.parametrize("offered, prompt, cached, external, expected", [
    # Under eviction the proxy's index guessed P's local hit; vLLM's own count is the truth:
    (4608, 4700, 4608, 3712, (h.HIT, 3712)),    # P kept 896 of 4,608 (index said 2,560): pulled 3,712
    (1031, 1181, 1030, 134, (h.HIT, 134)),      # the scheduler recomputed the last token: 1030 - 896
    (551, 700, 512, 0, (h.MISS_BELOW_THRESHOLD, 0)),   # 551 - 512 = 39 < 64: recomputed
    (896, 1100, 896, 0, (h.MISS_BELOW_THRESHOLD, 0)),  # P's own cache covers the whole handle
    (896, 1100, 895, 0, (h.MISS_BELOW_THRESHOLD, 0)),  # ... but its last token
    (723, 784, 768, 0, (h.MISS_BELOW_THRESHOLD, 0)),   # 768 > 723: P's own cache beyond the handle
    (731, 900, 640, 0, (h.MISS_TRANSFER_FAILED, 0)),   # 91 >= 64 short and nothing pulled: declined
    (500, 700, None, 0, (h.MISS_TRANSFER_FAILED, 0)),  # P reported nothing
])
def test_split_prefill_takes_vllms_count(offered, prompt, cached, external, expected):
    assert split_prefill(offered, prompt, cached, external, threshold=64) == expected


def test_drop_decode_drops_only_that_decode_workers_older_handles():
    clock = Clock()
    t = h.HandleTable(ttl_s=450, clock=clock)
    for sid in ("a", "b", "c", "new"):
        t.take(sid)
    t.put("a", {"remote_num_tokens": 10, "remote_engine_id": "D1"}, "decode-0", range(11))
    t.put("b", {"remote_num_tokens": 10, "remote_engine_id": "D1"}, "decode-0", range(11))
    t.put("c", {"remote_num_tokens": 10, "remote_engine_id": "E1"}, "decode-1", range(11))
    t.put("new", {"remote_num_tokens": 10, "remote_engine_id": "D2"}, "decode-0", range(11))
    clock.t += 7.0
    assert t.drop_decode("decode-0", keep_engine_id="D2") == 2  # a and b; not decode-1's, not D2's
    assert t.take("a") == (None, h.MISS_DECODE_RESTARTED) and t.age_of_last_taken("a") == 7.0
    assert t.take("a") == (None, h.MISS_CONSUMED)  # the marker is single use too
    assert t.take("b")[1] == h.MISS_DECODE_RESTARTED
    assert t.take("c")[0] is not None and t.take("new")[0] is not None
    # a new handle after the restart replaces the marker
    t.put("b", {"remote_num_tokens": 10, "remote_engine_id": "D2"}, "decode-0", range(11))
    assert t.take("b")[0] is not None


def test_decode_lifetimes_see_a_restart_by_process_start_or_engine_id():
    from serving.decode_lifetimes import DecodeLifetimes, process_start_s

    seen = []
    life = DecodeLifetimes(lambda worker, engine_id: seen.append((worker, engine_id)))
    assert not life.saw_start("decode-0", 1000.0) and not life.saw_start("decode-0", 1000.0)
    assert not life.saw_engine_id("decode-0", "D1") and not life.saw_engine_id("decode-0", "D1")
    assert life.saw_start("decode-0", 2000.0)              # restarted: the engine id is forgotten
    assert not life.saw_engine_id("decode-0", "D2")        # the new engine's first handle: no second restart
    assert life.saw_engine_id("decode-0", "D3")            # another engine id without a probe: a restart
    assert seen == [("decode-0", None), ("decode-0", "D3")]
    text = ("# HELP python_info x\n# TYPE python_info gauge\npython_info{version=\"3\"} 1.0\n"
            "# HELP process_start_time_seconds x\n# TYPE process_start_time_seconds gauge\n"
            "process_start_time_seconds 1.7e9\n")
    assert process_start_s(text) == 1.7e9 and process_start_s("python_info 1\n") is None
    assert process_start_s("not { metrics") is None
