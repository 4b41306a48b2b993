"""A cost profile whose prefill curve was measured: one decoder layer timed on the target GPU
(``bench/layer_prefill.py``), fitted and scaled to the model, the rest of the profile kept from a
published one (docs/planner/profiles.md).

From the timings t_i of one layer's prefill of x_i tokens from scratch::

    t(x) = a1 x + a2 x^2            one layer, fitted with non-negative least squares of the
                                    relative error (scipy.optimize.nnls on rows divided by t_i)
    c(x) = layers x t(x)            the model's prefill of x tokens (the profile's c(x))

``b0`` is kept from the base profile, or re-derived from a published TTFT of one prompt length
(the anchor: ``b0 = ttft - c(tokens)``), so that the profile still meets that published point; a
second published point (the check) then says how far the measured curve is from the publication.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator
from scipy.optimize import nnls

from core import yaml_file
from core.modes import AGGREGATED, RECOMPUTE_MODE
from planner.layer_shape import LAYER_TIMING_FORMAT, DecoderLayerShape
from planner.profile import CostProfile, ProfileError, Sourced, load_profile


class TimingPoint(BaseModel):
    """One prompt length's timing: ``tokens``, the median ``layer_s`` (seconds, one layer) and the
    per-repeat ``samples_s``."""

    model_config = ConfigDict(extra="forbid")
    tokens: int = Field(gt=0)
    layer_s: float = Field(gt=0)
    samples_s: list[float] = Field(default_factory=list)


class LayerTiming(BaseModel):
    """The JSON document ``bench/layer_prefill.py`` writes (format ``turnscope-layer-timing/1``)."""

    model_config = ConfigDict(extra="forbid")
    format: str
    config: str
    model_type: str = ""
    shape: DecoderLayerShape
    dtype: str
    device: str
    torch: str
    attention: str
    measured_at: str
    points: list[TimingPoint] = Field(min_length=2)

    @field_validator("shape")
    @classmethod
    def _positive_shape(cls, shape: DecoderLayerShape) -> DecoderLayerShape:
        for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "layers", "tp"):
            if getattr(shape, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(shape, name)}")
        return shape

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        if value != LAYER_TIMING_FORMAT:
            raise ValueError(f"expected {LAYER_TIMING_FORMAT!r} (bench/layer_prefill.py's output), got {value!r}")
        return value


def load_layer_timing(path: str | Path) -> LayerTiming:
    """Read ``bench/layer_prefill.py``'s JSON output.

    Raises:
        ProfileError: unreadable file, bad JSON (with its line) or a field that is missing or of the
            wrong kind (named by its path, e.g. ``points.1.layer_s``).
    """
    return yaml_file.load_model(Path(path), LayerTiming, "layer timing", ProfileError)


@dataclass(frozen=True)
class LayerCurve:
    """t(x) = ``a1_s`` x + ``a2_s`` x^2 of one layer (seconds per token, per token squared), fitted
    to ``points``; ``relative_residuals`` is (fit - measured) / measured per point."""

    a1_s: float
    a2_s: float
    points: tuple[TimingPoint, ...]
    relative_residuals: tuple[float, ...]


def fit_layer_curve(points: list[TimingPoint]) -> LayerCurve:
    """Fit t(x) = a1 x + a2 x^2 with a1, a2 >= 0 minimising the relative error (each point's row
    divided by its time, so short and long prompts weigh alike), by ``scipy.optimize.nnls``.

    Raises:
        ProfileError: fewer than two distinct lengths (a1 and a2 are not separable).
    """
    x = np.array([p.tokens for p in points], dtype=float)
    t = np.array([p.layer_s for p in points], dtype=float)
    if len(np.unique(x)) < 2:
        raise ProfileError("layer timing: field points: at least two distinct token counts are needed to fit a1 and a2")
    (a1, a2), _ = nnls(np.column_stack([x / t, x * x / t]), np.ones_like(t))
    fitted = a1 * x + a2 * x * x
    return LayerCurve(float(a1), float(a2), tuple(points), tuple(float(r) for r in (fitted - t) / t))


@dataclass(frozen=True)
class PublishedTTFT:
    """A published TTFT (seconds) of a prompt of ``tokens`` tokens computed from scratch, and where
    it was published.

    Raises:
        ProfileError: tokens not a positive integer, or a TTFT that is not a positive finite number.
    """

    tokens: int
    ttft_s: float
    source: str

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens <= 0:
            raise ProfileError(f"published TTFT ({self.source}): tokens must be a positive integer, got {self.tokens!r}")
        if not (np.isfinite(self.ttft_s) and self.ttft_s > 0):
            raise ProfileError(f"published TTFT ({self.source}): the TTFT must be a positive number of seconds, "
                               f"got {self.ttft_s!r}")


#: A fit that misses a timed length by more than this is flagged (relative error).
FIT_WARNING = 0.10
#: A check against a published TTFT off by more than the planner's own bound is flagged
#: (docs/planner/held-out.md: 25%).
CHECK_WARNING = 0.25


def measured_profile(base: CostProfile, timing: LayerTiming, curve: LayerCurve, name: str | None = None,
                     anchor: PublishedTTFT | None = None) -> CostProfile:
    """``base`` with its prefill curve in P/D modes replaced by the measured one (c(x) = layers x
    t(x)), and ``b0_default_s`` re-derived from ``anchor`` when given (``anchor.ttft_s -
    c(anchor.tokens)``). With an anchor, per-mode b0 figures derived against the old curve are
    dropped: every mode's but the aggregated worker's when the base gives that worker its own c(x),
    which is kept (not measured) with its b0. The base's ``held_out`` errors go too: they were of the
    base's curve, so every forecast of the new profile says "no held-out interval" until its own
    held-out check (``turnscope plan-check --profile ... --write-profile``) gives it one.

    The new figures' sources say they were measured, on what and how (their first clause, up to
    ': ', is what ``turnscope plan`` prints); ``left_out`` loses the lines about the figures now
    measured.

    Raises:
        ProfileError: the anchor's published TTFT is shorter than the measured prefill alone (b0
            would be negative: the timing is not of the published set-up).
    """
    layers = timing.shape.layers
    a1, a2 = curve.a1_s * layers, curve.a2_s * layers
    lengths = ", ".join(f"{p.tokens:,}" for p in curve.points)
    how = (f"MEASURED {timing.measured_at[:10]} on {timing.device} ({timing.dtype}, tp {timing.shape.tp}): one "
           f"{timing.model_type or 'decoder'} layer of {timing.config} ({timing.shape.heads} query / "
           f"{timing.shape.kv_heads} KV heads, MLP {timing.shape.intermediate} per GPU) with random weights, torch "
           f"{timing.torch}, {timing.attention}, at {timing.measured_at}; median times at {lengths} tokens, "
           f"t(x) = a1 x + a2 x^2 fitted by scipy.optimize.nnls of relative error (residuals "
           f"{', '.join(f'{r:+.1%}' for r in curve.relative_residuals)}), x {layers} layers "
           "(bench/layer_prefill.py, planner.layer_timing). Not timed: embedding and LM head, "
           "tensor parallelism's all-reduces, vLLM's scheduler and paged-KV writes, P's hand-off of KV to D")
    update: dict = {"prefill_a1_s_per_token": Sourced(value=a1, source=how),
                    "prefill_a2_s_per_token2": Sourced(value=a2, source=how)}
    replaced = ["prefill_a1_s_per_token", "prefill_a2_s_per_token2"]
    if anchor is not None:
        c = a1 * anchor.tokens + a2 * anchor.tokens ** 2
        b0 = anchor.ttft_s - c
        if b0 < 0:
            raise ProfileError(f"anchor: the published TTFT {anchor.ttft_s:.3f} s at {anchor.tokens:,} tokens is "
                               f"shorter than the measured prefill alone ({c:.3f} s): the timing is not of the "
                               "published set-up (another GPU, tensor parallelism or dtype?)")
        update["b0_default_s"] = Sourced(value=b0, source=(
            f"derived: {anchor.ttft_s:.4g} s published at {anchor.tokens:,} tokens ({anchor.source}) minus the "
            f"measured c({anchor.tokens:,}) = {c:.4g} s"))
        own_curve = base.aggregated_prefill_a1_s_per_token is not None
        update["b0_s"] = {m: f for m, f in base.b0_s.items() if own_curve and m == AGGREGATED}
        replaced += ["b0_default_s", "b0_s"]
    left_out = [line for line in base.left_out if not any(line.startswith(f) for f in replaced)]
    update["held_out"] = None   # the base's errors were of the replaced curve
    data = base.model_dump() | update | {"left_out": left_out, "name": name or f"{base.name}-measured",
                                         "description": (f"{base.description} Prefill curve measured on "
                                                         f"{timing.device} (bench/layer_prefill.py).").strip()}
    return CostProfile.model_validate(data)


def warnings_of(base: CostProfile, timing: LayerTiming, curve: LayerCurve,
                published: list[tuple[PublishedTTFT, float | None]]) -> list[str]:
    """What an operator should know before trusting a measured profile: a fit that misses a timed
    length by more than :data:`FIT_WARNING`, a published point outside the timed lengths (the
    curve extrapolated), a check off by more than :data:`CHECK_WARNING` (``published`` pairs each
    point with its relative error, None for the anchor), a CPU timing, and an aggregated c(x) kept
    from the base."""
    out: list[str] = []
    worst = max(curve.relative_residuals, key=abs)
    if abs(worst) > FIT_WARNING:
        out.append(f"the fit misses a timed length by {worst:+.1%} (over {FIT_WARNING:.0%}): time more lengths "
                   "or more repeats")
    lo, hi = min(p.tokens for p in curve.points), max(p.tokens for p in curve.points)
    for point, err in published:
        if not lo <= point.tokens <= hi:
            out.append(f"{point.tokens:,} tokens ({point.source}) is outside the timed lengths ({lo:,}-{hi:,}): "
                       "the curve is extrapolated there")
        if err is not None and abs(err) > CHECK_WARNING:
            out.append(f"the measured curve is {err:+.1%} off the TTFT published at {point.tokens:,} tokens (over "
                       f"{CHECK_WARNING:.0%}): the timing may not be of the published set-up")
    if timing.device.startswith("CPU"):
        out.append(f"timed on a CPU ({timing.device}): not a GPU's prefill curve")
    if base.aggregated_prefill_a1_s_per_token is not None:
        out.append("the aggregated worker's own c(x) is kept from the base profile (not measured)")
    return out


def check_against(profile: CostProfile, published: PublishedTTFT) -> tuple[float, float]:
    """The profile's TTFT of a prompt computed from scratch in ``pd-nocache`` (b0 + c(n): no cache,
    no pull) at ``published.tokens``, and its relative error against ``published.ttft_s``."""
    ttft = float(profile.ttft_s(RECOMPUTE_MODE, np.array([published.tokens]), np.zeros(1), np.zeros(1))[0])
    return ttft, (ttft - published.ttft_s) / published.ttft_s


def achieved_flops_per_s(timing: LayerTiming, point: TimingPoint) -> float:
    """FLOPs per second one layer reached at ``point`` (``DecoderLayerShape.prefill_flops`` over
    the median time), to compare with the GPU's published peak."""
    matmul, attention = timing.shape.prefill_flops(point.tokens)
    return (matmul + attention) / point.layer_s


def write_profile(profile: CostProfile, path: Path, header: str) -> None:
    """Write ``profile`` as a YAML profile file (the format ``load_profile`` reads), with ``header``
    as its leading comment."""
    body = yaml.safe_dump(profile.model_dump(mode="json", exclude_none=True), sort_keys=False, width=100, allow_unicode=True)
    comment = "".join(f"# {line}\n".replace("# \n", "#\n") for line in header.splitlines())
    path.write_text(comment + body)


def write_measured_profile(timing_path: Path, base_path: Path, out: Path, name: str | None = None,
                           anchor: PublishedTTFT | None = None, check: PublishedTTFT | None = None) -> str:
    """``turnscope profile-from-timing``: read the timings and the base profile, fit, write the
    measured profile to ``out`` (its header says the same as the returned report; the check and
    the warnings also end its ``description``) and return the report: each length's time per layer
    and for the model, the fit's residual, the FLOP rate reached, c(x), b0, the check's error when
    ``check`` is given, and :func:`warnings_of`.

    Raises:
        ProfileError: as :func:`load_layer_timing`, ``load_profile``, :func:`fit_layer_curve` and
            :func:`measured_profile`.
        OSError: ``out`` cannot be written.
    """
    if Path(out).resolve() in {Path(timing_path).resolve(), Path(base_path).resolve()}:
        raise ProfileError(f"--out {out}: would overwrite an input; give another path")
    if not Path(out).parent.is_dir():
        raise ProfileError(f"--out {out}: folder {Path(out).parent} does not exist")
    timing = load_layer_timing(timing_path)
    curve = fit_layer_curve(timing.points)
    base = load_profile(base_path)
    profile = measured_profile(base, timing, curve, name=name, anchor=anchor)
    layers = timing.shape.layers
    kept = "b0 re-derived from the anchor, every other figure" if anchor else "every other figure"
    lines = [(f"profile {profile.name}: prefill curve MEASURED on {timing.device} ({timing.dtype}, tp "
              f"{timing.shape.tp}, {timing.measured_at}) for {timing.config}; {kept} from {base_path} "
              f"({base.model or base.name})")]
    for point, resid in zip(curve.points, curve.relative_residuals, strict=True):
        lines.append(f"  {point.tokens:>9,} tokens: {point.layer_s * 1e3:9.3f} ms per layer, "
                     f"{point.layer_s * layers:8.3f} s for {layers} layers (fit {resid:+.1%}), "
                     f"{achieved_flops_per_s(timing, point) / 1e12:.3g} TFLOP/s")
    lines.append(f"  c(x) = {profile.prefill_a1_s_per_token.value:.4g} x + "
                 f"{profile.prefill_a2_s_per_token2.value:.4g} x^2 s; b0 {profile.b0_default_s.value:.4g} s "
                 f"({'re-derived from the anchor' if anchor else 'from the base profile'})")
    published: list[tuple[PublishedTTFT, float | None]] = [(anchor, None)] if anchor else []
    if check is not None:
        ttft, err = check_against(profile, check)
        published.append((check, err))
        lines.append(f"  check: pd-nocache TTFT at {check.tokens:,} tokens {ttft:.3f} s against "
                     f"{check.ttft_s:.3f} s published ({err:+.1%})")
    warnings = warnings_of(base, timing, curve, published)
    lines += [f"  WARNING: {w}" for w in warnings]
    why = " (the base's held-out errors were of its own curve)" if base.held_out else ""
    lines.append(f"  no held-out interval yet{why}: record runs on this deployment, then `turnscope plan-check "
                 f"--profile {out} --check-store STORE --write-profile FILE` stores this profile's own errors, the "
                 "source of its 80% intervals (docs/planner/held-out.md)")
    # the check and the warnings travel with the profile (the Plan page shows its fields, not this header)
    said = [line.strip() for line in lines if line.lstrip().startswith(("check:", "WARNING:"))]
    if said:
        profile = profile.model_copy(update={"description": " ".join([profile.description, *said])})
    write_profile(profile, out, "\n".join([f"Written by `turnscope profile-from-timing {timing_path}`.", *lines]))
    return "\n".join([*lines, f"wrote {out}"])
