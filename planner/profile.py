"""A cost profile: what prefill, KV transfer and KV space cost on one deployment, for the planner.

A profile is a YAML file (``data/profiles/*.yaml``, format in docs/planner/profiles.md) or is fitted from a
recorded run's own turns (:mod:`planner.fit`). Every figure carries its source; a figure
that cannot be sourced is absent (``None``) and the planner says what it left out.

The model of one request's TTFT, seconds (n prompt tokens, of which ``cached`` are not computed:
P's or the aggregated worker's own prefix-cache hit plus the tokens pulled from D)::

    ttft(mode) = b0[mode] + c(n) - c(cached) + pull(pulled) + handoff(mode)
    c(x)       = a1 x + a2 x^2                      (prefill of x tokens from scratch, no b0;
                                                     the aggregated worker may have its own a1, a2)
    pull(t)    = latency + t x kv_bytes_per_token / bandwidth   (0 when t = 0)
    handoff    = handoff_wait + d_first_step        (P/D modes; 0 in aggregated)

The planner adds two terms of the traffic, not of one request (:mod:`planner.simulate`):
the wait for the prefill worker (``+ wait``, FIFO per worker, :mod:`planner.queueing`)
and, for chat requests the workers render to token ids, ``render_s_per_token x n x renders``.

``c(n) - c(cached)`` is the cost of the new tokens after ``cached`` ones: attention makes it grow
with the context (the same form as the Sweep page's ideal, ``analysis.sweep_stats.PrefillFit``, whose
``cost_s`` is reused here). ``b0`` is what a mode adds whatever the prompt (routing, the prefill
leg's round trip, the engines' frontends). P/D's hand-off is two terms of its own where the profile
has them: D's wait for P's KV (``handoff_wait_s``: D's ``vllm:request_queue_time_seconds`` when D
has room) and D's first step (``d_first_step_s``: D's ``vllm:request_prefill_time_seconds``); a
profile without them keeps them inside b0.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from analysis.sweep_stats import PrefillFit
from core import yaml_file
from core.contract import Role
from core.modes import AGGREGATED, PLAN_ORDER, RECOMPUTE_MODE

#: The modes the planner forecasts, aggregated first, then one-way and bidirectional P/D.
MODES = PLAN_ORDER
GiB = 2**30


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and field."""


class Sourced(BaseModel):
    """A figure and where it comes from (a publication, a measurement, a derivation)."""

    model_config = ConfigDict(extra="forbid")
    value: float
    source: str = Field(min_length=1)


class HeldOutErrors(BaseModel):
    """How far the profile's forecasts were off on runs it was not fitted on (``turnscope
    plan-check``, docs/planner/held-out.md), the source of every forecast interval.

    ``split``: what was fitted on and what was checked; ``runs``/``turns``: the checked runs and
    ok turns. Per mode: ``ttft_ratio`` = [10th, 90th] percentile of measured / forecast TTFT over
    the checked ok turns (a forecast x reads "x (80% interval x lo - x hi)"); ``hit_rate_error``
    = [10th, 90th] percentile over the checked runs of the recorded minus the forecast hit rate
    (share of later ok turns, -1..1)."""

    model_config = ConfigDict(extra="forbid")
    split: str = Field(min_length=1)
    runs: int = Field(ge=1)
    turns: int = Field(ge=1)
    ttft_ratio: dict[str, tuple[float, float]] = Field(default_factory=dict)
    hit_rate_error: dict[str, tuple[float, float]] = Field(default_factory=dict)


class CostProfile(BaseModel):
    """The planner's costs for one deployment (seconds, tokens, bytes).

    * ``prefill_a1_s_per_token``, ``prefill_a2_s_per_token2``: c(x) = a1 x + a2 x^2 in P/D modes
      (P's prefill and the hand-off of the new tokens' KV to D);
    * ``aggregated_prefill_a1_s_per_token``, ``aggregated_prefill_a2_s_per_token2``: c(x) of the
      aggregated worker (absent: P's);
    * ``b0_s``: per-mode fixed cost (a mode absent uses ``b0_default_s``; a fitted profile gives a
      mode it had no turns of its sibling's, ``fit.sibling_b0``);
    * ``pull_latency_s``, ``pull_bandwidth_bytes_per_s``: P's pull of D's KV;
    * ``handoff_wait_s``, ``d_first_step_s``: P/D's hand-off, per request: D's wait for P's KV
      (D's ``vllm:request_queue_time_seconds`` with room on D) and D's first step (D's
      ``vllm:request_prefill_time_seconds``); absent: inside b0 (:meth:`handoff_s`);
    * ``kv_bytes_per_token``: the model's KV size (``serving.kv_size``);
    * ``decode_kv_space_bytes``, ``prefill_kv_space_bytes``, ``aggregated_kv_space_bytes``: KV
      space of one worker of that role (absent: unbounded, said so in every output);
    * ``decode_s_per_token``: time per output token, for when a trace gives no server time;
    * ``render_s_per_token``: time to render a chat request's messages to token ids (the chat
      template and the tokenizer), per prompt token, per render on the TTFT path (traffic sent as
      token ids renders nothing; absent: 0);
    * ``block_size``: KV block size in tokens (vLLM: 16 on GPU by default, 128 on CPU);
    * ``held_out``: the errors of this profile's forecasts on runs it was not fitted on
      (:class:`HeldOutErrors`; absent: no held-out check, so no forecast interval);
    * ``probe_ttft_s``: the speed probe's median TTFT on the machine the costs were fitted on
      (docs/planner/calibration.md; absent: forecasts are not scaled to a run's speed).
    * ``host_kv_space_bytes``, ``host_read_bandwidth_bytes_per_s``, ``host_read_latency_s``: a
      host-memory KV tier of one prefill worker (vLLM's OffloadingConnector) and the link P reads
      it back over (absent: no host-tier forecast; :mod:`planner.ledger`);
    * ``gpus_per_worker``, ``gpu_memory_bytes``: GPUs of one worker and the memory of one GPU, to
      turn held GiB-seconds and prefill seconds into GPU-hours (absent: 1 GPU; no memory price).
    * ``max_num_batched_tokens``: the engine's token budget per scheduler step on the prefill (and
      aggregated) workers, tokens: prompts that overlap are computed in shared steps
      (:func:`planner.queueing.batched_step_waits`; absent: each prompt holds its worker
      alone, first come first served).
    * ``host_contention_per_request``: how much a request's own work on the TTFT path (compute, pull,
      b0, renders) grows per other request in flight on the same host, dimensionless
      (``bench/host_contention.py``; :mod:`planner.host_contention`; absent: no such term,
      as on a serving host whose proxy and clients do not share the workers' cores).
    """

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    description: str = ""
    model: str = ""
    block_size: int = Field(gt=0)
    kv_bytes_per_token: Sourced
    prefill_a1_s_per_token: Sourced
    prefill_a2_s_per_token2: Sourced | None = None
    aggregated_prefill_a1_s_per_token: Sourced | None = None
    aggregated_prefill_a2_s_per_token2: Sourced | None = None
    b0_default_s: Sourced
    b0_s: dict[str, Sourced] = Field(default_factory=dict)
    pull_latency_s: Sourced | None = None
    pull_bandwidth_bytes_per_s: Sourced
    handoff_wait_s: Sourced | None = None
    d_first_step_s: Sourced | None = None
    prefix_step_s: Sourced | None = None
    context_scale: Sourced | None = None
    decode_kv_space_bytes: Sourced | None = None
    prefill_kv_space_bytes: Sourced | None = None
    aggregated_kv_space_bytes: Sourced | None = None
    decode_s_per_token: Sourced | None = None
    render_s_per_token: Sourced | None = None
    held_out: HeldOutErrors | None = None
    probe_ttft_s: Sourced | None = None
    host_kv_space_bytes: Sourced | None = None
    host_read_bandwidth_bytes_per_s: Sourced | None = None
    host_read_latency_s: Sourced | None = None
    gpus_per_worker: Sourced | None = None
    gpu_memory_bytes: Sourced | None = None
    max_num_batched_tokens: Sourced | None = None
    host_contention_per_request: Sourced | None = None
    left_out: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _known_modes(self) -> CostProfile:
        unknown = sorted(set(self.b0_s) - set(MODES))
        if unknown:
            raise ValueError(f"b0_s has unknown mode(s) {', '.join(unknown)}; modes are {', '.join(MODES)}")
        return self

    # -- the cost model -------------------------------------------------------------------------

    def prefill_fit(self, mode: str = RECOMPUTE_MODE) -> PrefillFit:
        """c(x) of ``mode`` as the Sweep page's :class:`analysis.sweep_stats.PrefillFit` (b0 is per mode
        here): the aggregated worker's when the profile has it, else P's."""
        a1, a2 = self.prefill_a1_s_per_token, self.prefill_a2_s_per_token2
        if mode == AGGREGATED and self.aggregated_prefill_a1_s_per_token is not None:
            a1, a2 = self.aggregated_prefill_a1_s_per_token, self.aggregated_prefill_a2_s_per_token2
        a2v = a2.value if a2 else 0.0
        return PrefillFit(0.0, a1.value, a2v, 2 if a2v else 1, 0, 0, 0)

    def b0(self, mode: str) -> float:
        """The fixed cost of ``mode``, seconds."""
        return (self.b0_s.get(mode) or self.b0_default_s).value

    def handoff_s(self, mode: str) -> tuple[float, float]:
        """(D's wait for P's KV, D's first step) of a request in ``mode``, seconds: the profile's
        ``handoff_wait_s`` and ``d_first_step_s`` in a P/D mode (0 where absent: then inside b0), (0, 0)
        in ``aggregated`` (no hand-off)."""
        if mode == AGGREGATED:
            return 0.0, 0.0
        return (self.handoff_wait_s.value if self.handoff_wait_s else 0.0,
                self.d_first_step_s.value if self.d_first_step_s else 0.0)

    def pull_s(self, tokens: np.ndarray) -> np.ndarray:
        """Seconds to pull ``tokens`` tokens of KV from D (0 where tokens is 0)."""
        t = np.asarray(tokens, dtype=float)
        latency = self.pull_latency_s.value if self.pull_latency_s else 0.0
        per_token = self.kv_bytes_per_token.value / self.pull_bandwidth_bytes_per_s.value
        return np.where(t > 0, latency + t * per_token, 0.0)

    def prefill_compute_s(self, mode: str, prompt_tokens: np.ndarray, cached_tokens: np.ndarray) -> np.ndarray:
        """Seconds of the prefill worker's time for each request: ``c(n) - c(cached)``, which is
        ``c(m) + 2 a2 cached m`` for m = n - cached new tokens: their own cost and attention over
        the prefix, the latter times ``context_scale`` (1 without it: what a run's cached-prefix
        probe says attention over a prefix costs against the curve, :meth:`at_speed`), plus
        ``prefix_step_s`` where the request computes new tokens on a prefix it did not compute
        (``0 < cached < n``: its worker's own cache or KV pulled from D; 0 without the figure).
        No b0, no pull: the time a request holds its worker (:mod:`planner.queueing`)."""
        fit = self.prefill_fit(mode)
        n = np.asarray(prompt_tokens, dtype=float)
        cached = np.minimum(np.asarray(cached_tokens, dtype=float), n)
        new = n - cached
        scale = self.context_scale.value if self.context_scale else 1.0
        extra = self.prefix_step_s.value if self.prefix_step_s else 0.0
        return (fit.cost_s(new) + 2.0 * fit.a2_s * cached * new * scale
                + np.where((cached > 0) & (new > 0), extra, 0.0))

    def render_s(self, prompt_tokens: np.ndarray, renders: np.ndarray) -> np.ndarray:
        """Seconds spent rendering chat requests to token ids before their first token:
        ``render_s_per_token x prompt tokens x renders`` (0 without the figure)."""
        per = self.render_s_per_token.value if self.render_s_per_token else 0.0
        return per * np.asarray(prompt_tokens, dtype=float) * np.asarray(renders, dtype=float)

    def ttft_s(self, mode: str, prompt_tokens: np.ndarray, cached_tokens: np.ndarray,
               pulled_tokens: np.ndarray) -> np.ndarray:
        """Predicted TTFT of each request in ``mode``, seconds (arrays of equal length; see the
        module doc). ``cached_tokens`` includes ``pulled_tokens``."""
        return (self.b0(mode) + sum(self.handoff_s(mode)) + self.prefill_compute_s(mode, prompt_tokens, cached_tokens)
                + self.pull_s(pulled_tokens))

    def at_speed(self, factor: float, why: str, compute_factor: float | None = None,
                 compute_why: str | None = None, context_factor: float | None = None) -> CostProfile:
        """This profile on a machine ``factor`` times slower (> 1) or faster (< 1), each term by the
        probe that measures its kind of work (docs/planner/calibration.md):

        * by ``factor`` (the short speed probe's: fixed costs), every b0 (HTTP, the proxy, the
          engines' frontends), ``prefix_step_s`` (an engine step's fixed cost on a prefix) and
          ``pull_latency_s`` (P's wait for an async pull beyond its bytes: the steps of an idle
          engine until the read is done);
        * by ``compute_factor`` (the compute probe's) when given, else by ``factor``, the engines'
          compute: the prefill curves c(x) (P's and the aggregated worker's), the hand-off (D's wait
          for P's KV and D's first step: engine steps on D, forward passes like the probe's) and the
          chat renders (``render_s_per_token``: tokenizer work per token, compute of the host's cores);
        * attention over a prefix (``context_scale``) to ``context_factor`` (the cached-prefix
          probe's, against the profile's own curve) when given, else with the curve.

        The pull's bandwidth, KV space and decode unchanged. ``why`` (and ``compute_why``) join each scaled
        figure's source."""
        def scaled(f: Sourced | None, by: float = factor, because: str = why) -> Sourced | None:
            return None if f is None else Sourced(value=f.value * by, source=f"{f.source}; x {by:.4g} ({because})")

        cf, cw = (factor, why) if compute_factor is None else (compute_factor, compute_why or why)
        scale = self.context_scale
        if context_factor is not None:   # the curve's a2 takes cf: the prefix's term is context_factor in all
            base = scale.value if scale else 1.0
            scale = Sourced(value=base * context_factor / cf, source=(
                f"attention over a prefix x {context_factor:.4g} against the profile's curve, which the compute "
                f"probe scales by {cf:.4g} ({cw})"))
        return self.model_copy(update={
            "b0_default_s": scaled(self.b0_default_s), "b0_s": {m: scaled(b) for m, b in self.b0_s.items()},
            "prefix_step_s": scaled(self.prefix_step_s), "pull_latency_s": scaled(self.pull_latency_s),
            "handoff_wait_s": scaled(self.handoff_wait_s, cf, cw), "d_first_step_s": scaled(self.d_first_step_s, cf, cw),
            "render_s_per_token": scaled(self.render_s_per_token, cf, cw), "context_scale": scale,
            "prefill_a1_s_per_token": scaled(self.prefill_a1_s_per_token, cf, cw),
            "prefill_a2_s_per_token2": scaled(self.prefill_a2_s_per_token2, cf, cw),
            "aggregated_prefill_a1_s_per_token": scaled(self.aggregated_prefill_a1_s_per_token, cf, cw),
            "aggregated_prefill_a2_s_per_token2": scaled(self.aggregated_prefill_a2_s_per_token2, cf, cw)})

    def capacity_tokens(self, role: str) -> int | None:
        """KV space of one worker of ``role`` (prefill, decode, aggregated) in tokens; None: unbounded."""
        figure = {Role.PREFILL: self.prefill_kv_space_bytes, Role.DECODE: self.decode_kv_space_bytes,
                  Role.AGGREGATED: self.aggregated_kv_space_bytes}[role]
        return None if figure is None else int(figure.value // self.kv_bytes_per_token.value)

    def label(self) -> str:
        """``FORECAST (profile <name>)``: how every planner output is labelled."""
        return f"FORECAST (profile {self.name})"


def with_decode_kv(profile: CostProfile, decode_kv_bytes: float | None) -> CostProfile:
    """``profile`` with one D's KV space set to ``decode_kv_bytes`` (bytes; None: ``profile`` as it
    is): how a fleet (:mod:`planner.fleet`) or a setting of the recommendation's grid
    (:mod:`planner.recommend`) states its D's space."""
    if decode_kv_bytes is None:
        return profile
    return profile.model_copy(update={"decode_kv_space_bytes": Sourced(value=decode_kv_bytes,
                                                                      source="the fleet's or setting's D KV space")})


def load_profile(path: str | Path) -> CostProfile:
    """Read a profile YAML file.

    Raises:
        ProfileError: unreadable file, bad YAML (with its line) or a field pydantic refuses (named
            by its path, e.g. ``pull_bandwidth_bytes_per_s.source``).
    """
    return yaml_file.load_model(Path(path), CostProfile, "profile", ProfileError)
