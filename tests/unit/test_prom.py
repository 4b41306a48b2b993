"""loadgen.prom against the handed /metrics cases (shared/cases/prometheus) and hand-made text."""

from __future__ import annotations

import json

import pytest

from loadgen.prom import (
    counter_increase,
    counter_total,
    engines,
    gauge_by_engine,
    gauge_max_over_engines,
    gauge_sum_over_engines,
    gauge_value,
    histogram_totals,
    itl_reading,
    parse_samples,
    prompt_token_sources,
    resolve_names,
    spec_decode_settings,
)
from tests.handed_cases import CASES as HANDED

CASES = HANDED / "prometheus"


def _case(stem: str) -> tuple[list, dict]:
    meta = json.loads((CASES / f"{stem}.expect.json").read_text())
    return parse_samples((CASES / meta["file"]).read_text()), meta["expect"]


def test_prom_cases_present() -> None:
    assert {p.name for p in CASES.glob("*")} >= {"created_series.prom", "per_pid_gauge.prom", "counter_reset.json",
                                                 "per_engine_series.prom", "prompt_tokens_by_source.prom"}


def test_prom_every_case_is_tested() -> None:
    """Each handed .expect.json is checked by a test named after it (a new case cannot slip by)."""
    tested = {name.removeprefix("test_prom_case_") for name in globals() if name.startswith("test_prom_case_")}
    handed = {p.name.removesuffix(".expect.json") for p in CASES.glob("*.expect.json")} | {"counter_reset"}
    assert handed <= tested, handed - tested


def test_prom_case_prompt_tokens_by_source() -> None:
    samples, exp = _case("prompt_tokens_by_source")
    src = prompt_token_sources(samples)
    assert (src.local_compute, src.local_cache_hit, src.external_kv_transfer) == (
        exp["local_compute"], exp["local_cache_hit"], exp["external_kv_transfer"])
    total = counter_total(samples, "vllm:prompt_tokens")
    assert total == exp["prompt_tokens_total"]
    assert (src.total == total) is exp["sources_sum_equals_total"]
    assert src.reused_fraction == pytest.approx(exp["reused_fraction"], abs=1e-6)
    assert src.external_fraction == pytest.approx(exp["external_fraction"], abs=1e-6)
    assert src.computed_fraction == pytest.approx(exp["computed_fraction"], abs=1e-6)
    assert counter_total(samples, "vllm:prompt_tokens_cached") == exp["cached_total"]
    # n = 2: the server counts each prompt twice, client usage once. A fraction taken against
    # client usage would exceed 1 (7680 reused of 4608 "prompt tokens"): the sources' own sum is
    # the only consistent denominator.
    client = exp["client_prompt_tokens_if_n_is_2"]
    assert total == 2 * client and (src.local_cache_hit + src.external_kv_transfer) / client > 1


def test_prom_case_per_engine_series() -> None:
    samples, exp = _case("per_engine_series")
    text = (CASES / "per_engine_series.prom").read_text()
    assert engines(samples) == exp["engines"]
    assert gauge_sum_over_engines(samples, "vllm:num_requests_running") == exp["num_requests_running"]
    assert gauge_sum_over_engines(samples, "vllm:num_requests_waiting") == exp["num_requests_waiting"]
    assert gauge_by_engine(samples, "vllm:kv_cache_usage_perc") == exp["kv_cache_usage_perc_by_engine"]
    assert gauge_max_over_engines(samples, "vllm:kv_cache_usage_perc") == exp["kv_cache_usage_perc_max"]
    queries = counter_total(samples, "vllm:prefix_cache_queries")
    hits = counter_total(samples, "vllm:prefix_cache_hits")
    assert (queries, hits) == (exp["prefix_cache_queries"], exp["prefix_cache_hits"])
    assert hits / queries == pytest.approx(exp["prefix_cache_hit_rate"])
    ttft = histogram_totals(text, "vllm:time_to_first_token_seconds")
    assert ttft.count == exp["ttft_count"]
    assert ttft.mean == pytest.approx(exp["ttft_mean_s"])
    assert ttft.fraction_at_or_below(0.5) == pytest.approx(exp["ttft_fraction_le_0_5_s"])
    # The one-engine readings the case warns of differ: engine 1 alone, or the last series read.
    assert counter_total(samples, "vllm:prefix_cache_hits", {"engine": "1"}) / counter_total(
        samples, "vllm:prefix_cache_queries", {"engine": "1"}) == 0.25
    with pytest.raises(ValueError, match="differ in more than pid"):
        gauge_value(samples, "vllm:kv_cache_usage_perc")  # no silent pick of one engine


def test_prom_histogram_errors() -> None:
    with pytest.raises(KeyError, match="not_there"):
        histogram_totals(TEXT, "not_there")
    h = histogram_totals(TEXT, "ttft")
    assert (h.count, h.sum, h.buckets) == (3.0, 0.75, ((0.1, 1.0), (float("inf"), 3.0)))
    with pytest.raises(ValueError, match="not a bucket bound"):
        h.fraction_at_or_below(0.2)


def test_prom_case_created_series() -> None:
    samples, exp = _case("created_series")
    assert not [s for s in samples if s.name.endswith("_created")]
    hits = counter_total(samples, "vllm:prefix_cache_hits")
    queries = counter_total(samples, "vllm:prefix_cache_queries_total")
    assert (hits, queries) == (exp["hits"], exp["queries"])
    assert hits / queries == pytest.approx(exp["hit_rate"], abs=1e-6)


def test_prom_case_nixl_failures_and_expiry() -> None:
    """vLLM's NIXL counters over two engines: failures summed per engine (5 + 2), the failed
    notifications read as the part of them they are (3 of the 7, never added: 10 would count 3
    twice), expiries apart from failures, notifications after expiry their own count (per remote
    rank: an alarm, not requests); the _created series (Unix times) never read."""
    samples, exp = _case("nixl_failures_and_expiry")
    assert engines(samples) == ["0", "1"]
    failed = counter_total(samples, "vllm:nixl_num_failed_transfers")
    notifications = counter_total(samples, "vllm:nixl_num_failed_notifications_total")
    assert failed == exp["failed_transfers"]
    assert notifications == exp["failed_notifications_within_failed_transfers"] and notifications <= failed
    assert counter_total(samples, "vllm:nixl_num_kv_expired_reqs") == exp["kv_expired_requests"]
    late = counter_total(samples, "vllm:nixl_num_notifications_after_expiry")
    assert late == exp["notifications_after_expiry"]
    assert (late > 0) is exp["possible_reuse_after_expiry_alarm"]
    assert counter_total(samples, "vllm:nixl_num_failed_transfers", {"engine": "1"}) == 2


def test_prom_case_per_pid_gauge() -> None:
    samples, exp = _case("per_pid_gauge")
    for name, value in exp.items():
        assert gauge_value(samples, name) == value


def test_prom_case_counter_reset() -> None:
    case = json.loads((CASES / "counter_reset.json").read_text())
    scrapes = [(s["process_start_time_seconds"], s["value"]) for s in case["scrapes"]]
    assert counter_increase(scrapes) == (case["expect"]["increase"], case["expect"]["restarts"])


def test_prom_restart_detected_without_a_drop() -> None:
    # Restarted between scrapes and already counted past the old value: 10 -> 12 is not +2 but +12.
    assert counter_increase([(1.0, 4), (1.0, 10), (2.0, 12)]) == (18, 1)
    # No start time exposed: only drops are seen (Prometheus semantics): 6 + 3 (reset) + 2.
    assert counter_increase([(None, 4), (None, 10), (None, 3), (None, 5)]) == (11, 1)
    assert counter_increase([(1.0, 5)]) == (0, 0)
    assert counter_increase([]) == (0, 0)


TEXT = """# HELP ttft Time to first token.
# TYPE ttft histogram
ttft_bucket{le="0.1",model_name="m"} 1.0
ttft_bucket{le="+Inf",model_name="m"} 3.0
ttft_count{model_name="m"} 3.0
ttft_sum{model_name="m"} 0.75
ttft_created{model_name="m"} 1.7e9
# HELP req Requests.
# TYPE req counter
req_total{outcome="hit"} 2.0
req_total{outcome="miss_first_turn"} 5.0
req_created{outcome="hit"} 1.7e9
# HELP live Live handles.
# TYPE live gauge
live{engine="0"} 3.0
live{engine="1"} 4.0
"""


def test_prom_parse_drops_buckets_keeps_sum_count() -> None:
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in parse_samples(TEXT)}
    assert got == {
        ("ttft_count", (("model_name", "m"),)): 3.0,
        ("ttft_sum", (("model_name", "m"),)): 0.75,
        ("req_total", (("outcome", "hit"),)): 2.0,
        ("req_total", (("outcome", "miss_first_turn"),)): 5.0,
        ("live", (("engine", "0"),)): 3.0,
        ("live", (("engine", "1"),)): 4.0,
    }


def test_prom_counter_total_sums_series_and_filters() -> None:
    s = parse_samples(TEXT)
    assert counter_total(s, "req") == 7.0
    assert counter_total(s, "req", labels={"outcome": "hit"}) == 2.0
    with pytest.raises(KeyError, match="'nope_total'"):
        counter_total(s, "nope")


def test_prom_gauge_ambiguities_raise() -> None:
    s = parse_samples(TEXT)
    with pytest.raises(ValueError, match="differ in more than pid"):
        gauge_value(s, "live")
    assert gauge_value(s, "live", labels={"engine": "1"}) == 4.0
    two = parse_samples('g{pid="1"} 0.2\ng{pid="2"} 0.5\n')
    with pytest.raises(ValueError, match="disagree"):
        gauge_value(two, "g")
    assert gauge_value(parse_samples('g{pid="1"} 0\ng{pid="2"} 0\n'), "g") == 0.0
    with pytest.raises(KeyError):
        gauge_value(s, "absent")


def test_prom_bad_text_names_source() -> None:
    with pytest.raises(ValueError, match="http://x/metrics"):
        parse_samples("vllm:num_requests_running abc\n", source="http://x/metrics")


def _renamed_case(stem: str) -> None:
    samples, exp = _case(stem)
    resolved = resolve_names(samples)
    s = resolved.samples
    assert gauge_max_over_engines(s, "vllm:kv_cache_usage_perc") == exp["kv_cache_usage_perc"]
    assert resolved.sources["vllm:kv_cache_usage_perc"] == exp["kv_cache_usage_source"]
    itl = itl_reading(samples)
    assert (itl.events, itl.per_event_s, itl.source) == (exp["itl_count"], exp["itl_mean_s"], exp["itl_source"])
    # never added: one measurement exposed twice stays one (0.74 and 800 would be the sum)
    assert len([x for x in s if x.name == "vllm:kv_cache_usage_perc"]) == 1
    assert [x.value for x in s if x.name == "vllm:inter_token_latency_seconds_count"] == [exp["itl_count"]]
    if "missing" in exp:
        assert resolved.missing == exp["missing"]
        for name in exp["missing"]:
            with pytest.raises(KeyError):
                counter_total(s, name)  # missing, not 0
    if "num_requests_running" in exp:
        assert gauge_sum_over_engines(s, "vllm:num_requests_running") == exp["num_requests_running"]


def test_prom_case_renamed_metrics_old_names() -> None:
    _renamed_case("renamed_metrics_old_names")


def test_prom_case_renamed_metrics_both_names() -> None:
    _renamed_case("renamed_metrics_both_names")


def test_prom_case_itl_per_output_event() -> None:
    samples, exp = _case("itl_per_output_event")
    itl = itl_reading(samples)
    assert itl.events == exp["itl_observations"]
    assert counter_total(samples, "vllm:request_success") == exp["requests"]
    assert counter_total(samples, "vllm:generation_tokens") == exp["generation_tokens"]
    assert itl.per_event_s == pytest.approx(exp["itl_mean_s_per_output_event"])
    assert itl.tokens_per_event == pytest.approx(exp["tokens_per_output_event"])
    assert itl.per_token_s == pytest.approx(exp["itl_mean_s_per_token"])
    assert itl.tpot_s == pytest.approx(exp["tpot_mean_s"])
    assert itl.per_event_s == pytest.approx(exp["wrong_if_itl_read_as_tpot_s"])  # labelled per event
    spec = spec_decode_settings(samples)
    assert spec.enabled and spec.mean_acceptance_length == pytest.approx(exp["spec_decode_mean_acceptance_length"])
    assert spec.draft_tokens_per_draft == 3.0  # 3000 draft tokens over 1000 drafts


def test_resolve_names_without_renamed_metrics_passes_samples_unchanged() -> None:
    samples, _ = _case("per_engine_series")
    resolved = resolve_names(samples)
    assert resolved.samples == samples
    assert resolved.sources["vllm:kv_cache_usage_perc"] == "vllm:kv_cache_usage_perc"
    assert resolved.missing == ["vllm:inter_token_latency_seconds"]
    assert not spec_decode_settings(samples).enabled
