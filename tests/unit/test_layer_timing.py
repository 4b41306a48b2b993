"""planner.layer_timing: the prefill curve fitted from one layer's timings and the profile
built on it, against hand-computed figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner import layer_timing as lt
from planner.layer_shape import LAYER_TIMING_FORMAT
from planner.profile import ProfileError, load_profile

REPO = Path(__file__).resolve().parents[2]
VENDOR = REPO / "data" / "profiles" / "vendor-h200.yaml"
EMBEDDED = REPO / "data" / "profiles" / "embedded-cpu.yaml"
A1, A2 = 2.0e-6, 3.0e-11  # one layer: seconds per token, per token squared


def _timing(tokens=(1024, 4096, 16384, 32768), layers=64, a1=A1, a2=A2) -> dict:
    return {"format": LAYER_TIMING_FORMAT, "config": "Qwen3-32B.json", "model_type": "qwen3",
            "shape": {"hidden": 5120, "heads": 8, "kv_heads": 1, "head_dim": 128, "intermediate": 3200,
                      "layers": layers, "tp": 8, "qk_norm": True},
            "dtype": "bfloat16", "device": "NVIDIA H200", "torch": "2.9.0", "attention": "sdpa",
            "measured_at": "2026-12-01T00:00:00+00:00",
            "points": [{"tokens": n, "layer_s": a1 * n + a2 * n * n} for n in tokens]}


def _load(tmp_path: Path, doc: dict) -> lt.LayerTiming:
    path = tmp_path / "layer.json"
    path.write_text(json.dumps(doc, indent=2))
    return lt.load_layer_timing(path)


def test_fit_recovers_the_curve_the_times_were_made_from(tmp_path):
    curve = lt.fit_layer_curve(_load(tmp_path, _timing()).points)
    assert curve.a1_s == pytest.approx(A1, rel=1e-9)
    assert curve.a2_s == pytest.approx(A2, rel=1e-9)
    assert max(abs(r) for r in curve.relative_residuals) < 1e-9


def test_fit_keeps_coefficients_non_negative(tmp_path):
    # times falling faster than linear: the best non-negative curve has no quadratic term
    doc = _timing(tokens=(1000, 2000))
    doc["points"] = [{"tokens": 1000, "layer_s": 1.0}, {"tokens": 2000, "layer_s": 1.5}]
    curve = lt.fit_layer_curve(_load(tmp_path, doc).points)
    assert curve.a2_s == 0.0 and curve.a1_s > 0


def test_measured_profile_scales_by_layers_and_rederives_b0_from_the_anchor(tmp_path):
    a1, a2 = 3.0e-7, 1.0e-13  # one layer of a TP-8 shard, near the vendor's 2.8e-5 s/token for 64 layers
    timing = _load(tmp_path, _timing(a1=a1, a2=a2))
    anchor = lt.PublishedTTFT(4175, 0.158, "vLLM blog 2026-10-12")
    profile = lt.measured_profile(load_profile(VENDOR), timing, lt.fit_layer_curve(timing.points), anchor=anchor)
    assert profile.name == "vendor-h200-measured"
    assert profile.prefill_a1_s_per_token.value == pytest.approx(64 * a1)
    assert profile.prefill_a2_s_per_token2.value == pytest.approx(64 * a2)
    assert profile.prefill_a1_s_per_token.source.startswith("MEASURED 2026-12-01")
    # by hand: c(4,175) = 64 x (3e-7 x 4,175 + 1e-13 x 4,175^2) = 0.0802716 s; b0 = 0.158 - c
    assert profile.b0_default_s.value == pytest.approx(0.0777284, abs=1e-7)
    assert "vLLM blog 2026-10-12" in profile.b0_default_s.source and profile.b0_s == {}
    # what was published stays; the left-out line about the quadratic term goes (it is measured now)
    assert profile.pull_bandwidth_bytes_per_s == load_profile(VENDOR).pull_bandwidth_bytes_per_s
    assert not any(line.startswith("prefill_a2") for line in profile.left_out)
    assert any(line.startswith("decode_s_per_token") for line in profile.left_out)
    # the check at the second published point: b0 + c(26,175) = 0.0777284 + 0.5069448 = 0.5846733 s
    ttft, err = lt.check_against(profile, lt.PublishedTTFT(26175, 0.778, "vLLM blog 2026-10-12"))
    assert ttft == pytest.approx(0.5846733, abs=1e-6)
    assert err == pytest.approx(-0.248492, abs=1e-5)


def test_profile_round_trips_through_its_yaml_file(tmp_path):
    timing = _load(tmp_path, _timing(a1=3.0e-7, a2=1.0e-13))
    profile = lt.measured_profile(load_profile(VENDOR), timing, lt.fit_layer_curve(timing.points))
    lt.write_profile(profile, tmp_path / "p.yaml", "a header\nof two lines")
    assert (tmp_path / "p.yaml").read_text().startswith("# a header\n# of two lines\n")
    again = load_profile(tmp_path / "p.yaml")
    assert again == profile
    assert again.b0_default_s == load_profile(VENDOR).b0_default_s  # no anchor: b0 kept


def test_anchor_faster_than_the_measured_prefill_is_refused(tmp_path):
    timing = _load(tmp_path, _timing())  # 64 x 2e-6 s/token: 0.57 s at 4,175 tokens
    with pytest.raises(ProfileError, match="0.158 s at 4,175 tokens is shorter than the measured prefill alone"):
        lt.measured_profile(load_profile(VENDOR), timing, lt.fit_layer_curve(timing.points),
                            anchor=lt.PublishedTTFT(4175, 0.158, "published"))


@pytest.mark.parametrize("change, message", [
    (lambda d: d["points"][1].pop("layer_s"), r"line \d+: layer timing field points\.1\.layer_s"),
    (lambda d: d.update(format="other/2"), "turnscope-layer-timing/1"),
    (lambda d: d.update(points=d["points"][:1]), "points"),
])
def test_bad_timing_file_names_the_field(tmp_path, change, message):
    doc = _timing()
    change(doc)
    with pytest.raises(ProfileError, match=message):
        _load(tmp_path, doc)


def test_aggregated_workers_own_curve_keeps_its_b0_and_is_flagged(tmp_path):
    """embedded-cpu gives the aggregated worker its own c(x) and b0: both are kept (not measured);
    the P/D modes' b0, derived against the replaced curve, go with the anchor."""
    timing = _load(tmp_path, _timing(a1=3.0e-7, a2=1.0e-13))
    curve = lt.fit_layer_curve(timing.points)
    base = load_profile(EMBEDDED)
    assert {"aggregated", "pd"} <= set(base.b0_s)
    anchor = lt.PublishedTTFT(4175, 2.0, "a run")
    profile = lt.measured_profile(base, timing, curve, anchor=anchor)
    assert profile.b0_s == {"aggregated": base.b0_s["aggregated"]}
    assert profile.aggregated_prefill_a1_s_per_token == base.aggregated_prefill_a1_s_per_token
    assert "the aggregated worker's own c(x) is kept from the base profile (not measured)" in lt.warnings_of(
        base, timing, curve, [(anchor, None)])
    # without an own curve the aggregated worker is costed by P's (measured) curve: no b0 of its own
    assert lt.measured_profile(load_profile(VENDOR), timing, curve, anchor=anchor).b0_s == {}


def test_warnings_for_a_profile_not_to_trust(tmp_path):
    doc = _timing(tokens=(64, 128, 256), a1=3.0e-7, a2=1.0e-13)
    doc["points"][1]["layer_s"] *= 1.5  # the fit cannot follow this point
    doc["device"] = "CPU x86_64 (1 threads)"
    timing = _load(tmp_path, doc)
    curve = lt.fit_layer_curve(timing.points)
    base = load_profile(VENDOR)
    warnings = lt.warnings_of(base, timing, curve, [(lt.PublishedTTFT(4175, 0.158, "blog"), None),
                                                    (lt.PublishedTTFT(200, 0.778, "blog"), 0.30)])
    assert any(w.startswith("the fit misses a timed length by") for w in warnings)
    assert "4,175 tokens (blog) is outside the timed lengths (64-256): the curve is extrapolated there" in warnings
    assert not any(w.startswith("200 tokens") for w in warnings)  # inside the timed lengths
    assert any(w.startswith("the measured curve is +30.0% off the TTFT published at 200 tokens") for w in warnings)
    assert "timed on a CPU (CPU x86_64 (1 threads)): not a GPU's prefill curve" in warnings
    clean = lt.warnings_of(base, _load(tmp_path, _timing()), lt.fit_layer_curve(_load(tmp_path, _timing()).points),
                           [(lt.PublishedTTFT(4175, 0.158, "blog"), None), (lt.PublishedTTFT(26175, 0.778, "blog"), -0.1)])
    assert clean == []


@pytest.mark.parametrize("tokens, ttft", [(0, 0.1), (-5, 0.1), (100, 0.0), (100, float("nan")), (100, -1.0)])
def test_published_points_must_be_positive(tokens, ttft):
    with pytest.raises(ProfileError, match="published TTFT"):
        lt.PublishedTTFT(tokens, ttft, "blog")


def test_a_timing_of_zero_layers_is_refused(tmp_path):
    doc = _timing()
    doc["shape"]["layers"] = 0
    with pytest.raises(ProfileError, match="layer timing field shape: .*layers must be a positive integer, got 0"):
        _load(tmp_path, doc)


def test_the_output_may_not_overwrite_an_input(tmp_path):
    _load(tmp_path, _timing())
    with pytest.raises(ProfileError, match="would overwrite an input"):
        lt.write_measured_profile(tmp_path / "layer.json", VENDOR, tmp_path / "layer.json")
    with pytest.raises(ProfileError, match="does not exist"):
        lt.write_measured_profile(tmp_path / "layer.json", VENDOR, tmp_path / "no" / "p.yaml")
