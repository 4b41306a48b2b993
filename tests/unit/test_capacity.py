"""turnscope capacity's step planning and analysis.capacity_crossing's crossing, against hand-written truths."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from analysis.capacity_crossing import crossing_words, find_crossing
from serving.topology import embedded_topology
from serving.workers import mode_workers, worker_command
from turnscope.conductor.capacity import plan_capacity
from turnscope.conductor.evaluation import EvalSettings, Slo

REPO = Path(__file__).resolve().parents[2]
WORKLOAD = REPO / "data" / "workloads" / "capacity.yaml"
SLO = Slo(ttft_s=0.5, tpot_s=0.05)


def _plan(**kw):
    args = {"capacity_id": "cap-x", "users": [1, 2, 4], "sessions_per_user": 3, "slo": SLO,
            "topology": embedded_topology("/m"), "kv_bytes_per_token": 4096}
    return plan_capacity(WORKLOAD, **(args | kw))


def _flag(argv: list[str], flag: str) -> str:
    """The value argparse keeps for a repeated store option: the last one."""
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag][-1]


def test_steps_run_ids_and_spec():
    plan = _plan()
    assert [(s.index, s.users, s.sessions) for s in plan.steps] == [(0, 1, 3), (1, 2, 6), (2, 4, 12)]
    assert plan.decode_kv_cache_bytes == 16_384 * 4096 == 64 * 2**20
    base = EvalSettings(topology=embedded_topology("/m"), modes=["pd", "pd-bidir"])
    runs = plan.runs(base, ["pd", "pd-bidir"], "token_ids")
    assert [r.run_id for r in runs["pd-bidir"]] == ["cap-x-pd-bidir-u1", "cap-x-pd-bidir-u2", "cap-x-pd-bidir-u4"]
    r = runs["pd"][2]
    assert (r.settings.users, r.settings.sessions, r.settings.workload, r.history) == (4, 12, WORKLOAD, "token_ids")
    assert r.settings.slo == SLO
    assert r.spec["capacity"] == {"id": "cap-x", "workload": "capacity", "step": 2, "users": 4, "sessions": 12,
                                       "steps": [1, 2, 4], "decode_kv_cache_bytes": 64 * 2**20,
                                       "decode_kv_tokens": 16_384, "decoder_kv_blocks_ttl_s": 20,
                                       "slo_ttft_s": 0.5, "slo_tpot_s": 0.05}
    assert r.settings.model_dump(mode="json")["slo"] == {"ttft_s": 0.5, "tpot_s": 0.05}  # what runs.config stores


def test_topology_gives_d_alone_the_small_kv_space_and_the_plan_ttl():
    plan = _plan(ttl_s=25, handle_ttl_margin_s=4.0)
    topo = plan.topology(embedded_topology("/m"))
    assert (topo.connector.decoder_kv_blocks_ttl, topo.proxy.handle_ttl_margin_s) == (25, 4.0)
    workers = {w.role: worker_command(w)[0] for w in mode_workers("pd-bidir", topo)}
    assert _flag(workers["decode"], "--kv-cache-memory-bytes") == str(64 * 2**20)
    assert _flag(workers["prefill"], "--kv-cache-memory-bytes") == str(512 * 2**20)  # P keeps the default
    assert '"decoder_kv_blocks_ttl": 25' in _flag(workers["decode"], "--kv-transfer-config")


def test_the_eviction_ladder_gives_p_its_space_and_aggregated_p_plus_d():
    plan = _plan(prefill_kv_tokens=16_384, decode_kv_tokens=32_768)
    topo = plan.topology(embedded_topology("/m"))
    workers = {w.role: worker_command(w)[0] for m in ("pd-bidir", "aggregated") for w in mode_workers(m, topo)}
    # 16,384 and 32,768 tokens x 4,096 bytes: 64 and 128 MiB; the aggregated worker their sum, 192 MiB
    assert _flag(workers["prefill"], "--kv-cache-memory-bytes") == str(64 * 2**20)
    assert _flag(workers["decode"], "--kv-cache-memory-bytes") == str(128 * 2**20)
    assert _flag(workers["aggregated"], "--kv-cache-memory-bytes") == str(192 * 2**20)
    spec = plan.spec(plan.steps[0])["capacity"]
    assert (spec["prefill_kv_cache_bytes"], spec["prefill_kv_tokens"], spec["aggregated_kv_cache_bytes"]) == (
        64 * 2**20, 16_384, 192 * 2**20)
    # without it the aggregated worker keeps the topology's 512 MiB and the spec has no P keys
    plain = _plan()
    agg = {w.role: worker_command(w)[0] for w in mode_workers("aggregated", plain.topology(embedded_topology("/m")))}
    assert _flag(agg["aggregated"], "--kv-cache-memory-bytes") == str(512 * 2**20)
    assert "prefill_kv_cache_bytes" not in plain.spec(plain.steps[0])["capacity"]


@pytest.mark.parametrize("kw, needle", [
    ({"prefill_kv_tokens": 8191}, "--prefill-kv-tokens 8191 is below max_model_len 8192"),
    ({"users": [2, 2, 4]}, "strictly ascending"),
    ({"users": [0, 1]}, "strictly ascending"),
    ({"users": []}, "at least one"),
    ({"sessions_per_user": 0}, "--sessions-per-user"),
    ({"decode_kv_tokens": 8191}, "below max_model_len 8192"),
    ({"ttl_s": 5, "handle_ttl_margin_s": 5.0}, "no time to offer a handle"),
])
def test_bad_plans_are_refused_with_the_field(kw, needle):
    with pytest.raises(ValueError, match=needle):
        _plan(**kw)


def test_a_bad_workload_names_its_file(tmp_path):
    bad = tmp_path / "w.yaml"
    bad.write_text("name: w\nmix: []\n")
    with pytest.raises(ValueError, match="w.yaml"):
        plan_capacity(bad, capacity_id="c", users=[1], sessions_per_user=1, slo=SLO,
                      topology=embedded_topology("/m"), kv_bytes_per_token=4096)


def _steps(rows):
    return pd.DataFrame(rows, columns=["mode", "users", "goodput_per_s", "ttft_p50_s", "ttft_p90_s"])


def test_crossing_by_goodput_with_the_tolerance():
    # 2 users: 0.96 vs 1.00 is within 5%; 3 users: 0.90 < 0.95 x 1.00
    steps = _steps([("pd", 1, 0.5, 0.30, 0.40), ("pd-bidir", 1, 0.5, 0.20, 0.30),
                    ("pd", 2, 1.0, 0.32, 0.45), ("pd-bidir", 2, 0.96, 0.22, 0.44),
                    ("pd", 3, 1.0, 0.35, 0.50), ("pd-bidir", 3, 0.90, 0.30, 0.50)])
    c = find_crossing(steps)
    assert (c.users, c.reason) == (3, "goodput")
    assert [p.users for p in c.below] == [1, 2]
    words = crossing_words(c)
    assert "at 3 concurrent sessions" in words and "goodput 0.90 vs 1.00 turns/s" in words
    assert "1: 300 ms → 200 ms; 2: 320 ms → 220 ms" in words
    assert find_crossing(steps, tolerance=0.0).users == 2  # 0.96 < 1.00 without a margin


def test_crossing_by_ttft_p90_and_steps_missing_in_one_mode_are_skipped():
    steps = _steps([("pd", 1, 0.5, 0.30, 0.40), ("pd-bidir", 1, 0.5, 0.20, 0.30),
                    ("pd-bidir", 2, 0.1, 0.2, 9.0),  # no pd step at 2: not compared
                    ("pd", 4, 1.0, 0.35, 0.50), ("pd-bidir", 4, 1.0, 0.30, 0.53),  # 0.53 > 0.525
                    ("pd", 6, 1.0, 0.35, 0.50), ("pd-bidir", 6, 0.5, 0.30, 2.0)])
    c = find_crossing(steps)
    assert (c.users, c.reason, [p.users for p in c.pairs]) == (4, "ttft_p90", [1, 4, 6])


def test_no_crossing_said_in_words():
    steps = _steps([("pd", 1, 0.5, 0.30, 0.40), ("pd-bidir", 1, 0.5, 0.20, 0.30),
                    ("pd", 2, 1.0, 0.32, 0.45), ("pd-bidir", 2, 1.0, 0.22, 0.44)])
    c = find_crossing(steps)
    assert c.users is None and len(c.below) == 2
    assert crossing_words(c).startswith("**No crossing within the steps measured** (1, 2 concurrent sessions)")
    assert "nothing to compare" in crossing_words(find_crossing(steps[steps["mode"] == "pd"]))
    with pytest.raises(ValueError, match="tolerance"):
        find_crossing(steps, tolerance=1.0)


def test_a_step_behind_with_a_later_step_not_behind_is_transient():
    # behind at 1 (p90), not at 2, behind at 3 (goodput) and 4 (both): the crossing is 3
    steps = _steps([("pd", 1, 0.5, 0.20, 0.25), ("pd-bidir", 1, 0.5, 0.50, 1.10),
                    ("pd", 2, 0.7, 0.31, 0.56), ("pd-bidir", 2, 0.7, 0.30, 0.55),
                    ("pd", 3, 1.2, 0.30, 0.60), ("pd-bidir", 3, 1.0, 0.30, 0.60),
                    ("pd", 4, 1.5, 0.30, 0.60), ("pd-bidir", 4, 1.0, 0.40, 0.90)])
    c = find_crossing(steps)
    assert (c.users, c.reason, c.transient, [p.users for p in c.below]) == (3, "goodput", (1,), [1, 2])
    assert "That is the last step measured" not in crossing_words(c)
    assert "It was behind at 1 concurrent session(s) too, but not at every step after" in crossing_words(c)
    # and with no lasting crossing at all: behind only at 1
    c = find_crossing(steps[steps["users"] <= 2])
    assert (c.users, c.transient) == (None, (1,))
    assert crossing_words(c).startswith("**No crossing within the steps measured** (1, 2 concurrent sessions): "
                                        "`pd-bidir` did not stay behind")


def test_crossing_at_the_first_step_says_nothing_below_is_known():
    steps = _steps([("pd", 1, 0.5, 0.30, 0.40), ("pd-bidir", 1, 0.2, 0.20, 0.30)])
    words = crossing_words(find_crossing(steps))
    assert "No step below it was measured" in words and "That is the last step measured" in words


def _with_turns(rows):
    """Steps with each step's ok TTFTs (``ttft_ok_s``); the figures are computed from them as
    DuckDB's quantile_cont computes them (numpy's linear interpolation)."""
    import numpy as np
    out = [(m, u, g, float(np.quantile(t, 0.5)), float(np.quantile(t, 0.9)), list(t)) for m, u, g, t in rows]
    return pd.DataFrame(out, columns=["mode", "users", "goodput_per_s", "ttft_p50_s", "ttft_p90_s", "ttft_ok_s"])


def test_a_p90_difference_within_sampling_noise_is_not_a_crossing():
    import numpy as np

    from analysis.capacity_crossing import p90_ratio_interval

    base = np.linspace(0.05, 0.20, 32)            # 32 turns, as a 2-session step of the ramp
    # 2 sessions: pd-bidir 5.6% slower at every turn (p90 ratio 1.056 > 1.05); 4 sessions: every
    # pd-bidir turn 3x every pd turn's constant 0.1 s, so every resample's ratio is exactly 3
    steps = _with_turns([("pd", 2, 1.0, base), ("pd-bidir", 2, 1.0, base * 1.056),
                         ("pd", 4, 1.0, np.full(32, 0.1)), ("pd-bidir", 4, 1.0, np.full(32, 0.3))])
    c = find_crossing(steps)
    assert (c.users, c.reason, c.within_noise) == (4, "ttft_p90", (2,))
    assert p90_ratio_interval(c.pairs[1]) == pytest.approx((3.0, 3.0))
    low, high = p90_ratio_interval(c.pairs[0])
    # a second route: resample both modes' turns with numpy and count resamples whose ratio is <= 1
    rng = np.random.default_rng(1)
    ratios = [np.quantile(rng.choice(base * 1.056, 32), 0.9) / np.quantile(rng.choice(base, 32), 0.9)
              for _ in range(4000)]
    assert np.mean(np.array(ratios) <= 1.0) > 0.025          # so the 95% interval reaches below 1
    assert low < 1.0 < high
    assert "At 2 concurrent session(s) `pd-bidir`'s TTFT p90 was higher by more than 5%, but within" \
        in crossing_words(c)
    # the same figures without the turns (a forecast): the point rule alone, 2 sessions behind
    figures = steps.drop(columns=["ttft_ok_s"])
    assert find_crossing(figures).users == 2
