"""Workload files: agent-session archetypes and trace replays, validated and planned (docs/workloads.md).

A workload is a YAML file (``data/workloads/*.yaml``) validated by :class:`Workload` (pydantic;
unknown keys are errors, and every error names the file and the field, e.g.
``coding-agent.yaml: mix.0.archetype.gaps.tool.p: Input should be less than or equal to 1``)::

    name: coding-agent
    seed: 7
    sessions: 24              # archetype sessions drawn from `mix` by weight
    ttl_s: 480                # the decode worker's KV TTL the workload is about
    mix:
      - weight: 1
        archetype:
          name: coding-agent
          turns: {kind: lognormal, median: 12, sigma: 0.5, min: 2, max: 40}
          system_prompt_tokens: 1800          # shared by all sessions of the archetype
          first_prompt_tokens: {kind: uniform, low: 300, high: 2500}
          new_tokens: {tool: {kind: lognormal, median: 600, sigma: 1.0}, think: 60, pause: 40}
          output_tokens: {kind: lognormal, median: 150, sigma: 0.6, min: 8, max: 600}
          gaps: {tool: {p: 0.8, seconds: {kind: lognormal, median: 8, sigma: 1.2}},
                 think: {p: 0.2, seconds: {kind: exponential, mean: 20}}}
          retry_p: 0.03
          edit_p: 0.05
          fresh_p: 0.05
          resume_p: 0.02
      - weight: 1
        include: research-assistant.yaml      # the mix entries of another workload file
    traces:
      - {format: mooncake, sessions: 20, min_turns: 2, token_scale: 0.1}

Distributions (``kind``): ``constant`` (``value``; a bare number means a constant), ``uniform``
(``low``, ``high``), ``lognormal`` (``median``, ``sigma`` of the log), ``exponential`` (``mean``),
``empirical`` (``values``, or ``trace`` ``mooncake``/``azure`` and ``field``, resampled from the
shipped trace); all take optional ``min``/``max`` clips. Sampling uses numpy's ``Generator``.

Planning (:func:`plan_workload`) is deterministic: archetype session i draws from
``numpy.random.defaultseeded_rng([seed, 1, i])`` and its text from :class:`loadgen.synth_text.TextSynth`
keyed by the session id, so the same seed gives the same plans (and adding sessions does not
change the earlier ones). Per turn after the first, an archetype session:

* may first send a ``fresh`` side request (``fresh_p``): an unrelated single request with its own
  session id, right after the previous turn (a title or summary call);
* is a ``retry`` (``retry_p``): the previous request sent again right after, same history;
* else draws its gap kind (``tool``/``think``/``pause`` by ``gaps.*.p``) and gap length; with
  ``resume_p`` the gap is a pause of ``ttl_s`` + ``resume.extra_s`` instead. A turn whose gap
  exceeds ``ttl_s`` is a ``resume`` (its KV has expired on the decode worker);
* appends the new tokens (a tool result after a ``tool`` gap, a user message otherwise);
* may edit the history (``edit_p``): the last (or, with ``edit.first_p``, the first) assistant
  reply is compacted to ``edit.keep`` of its characters, or its reasoning stripped.

Trace replays (``traces``): ``mooncake`` (sessions inferred from hash chains, text synthesized per
hash block so prefix sharing survives, arrivals replayed), ``azure`` (every row a one-turn session
at its arrival), ``taubench`` (full text; gaps from ``gaps``) and ``vllm_multiturn`` (vLLM's
multi-turn benchmark JSON; output length = the dataset reply's tokens) and ``kv_cache_tester``
(Claude Code sessions, sub-agents as their own concurrent sessions, :func:`plan_kv_cache_tester`).
``time_scale`` multiplies every gap and arrival offset (the scale is recorded with the run).

Sweeps (``sweep``): a workload may name one archetype field (``first_prompt_tokens``, each
session's own context, or ``system_prompt_tokens``, the prefix shared by all sessions) and the
token counts to sweep it over, plus other named scales of the same experiment (``scales``: their
own values, sessions and archetype field overrides). :func:`sweep_workloads` turns it into one
plain workload per point (the field a constant); ``turnscope sweep`` runs each as its own run.
``data/workloads/vendor-sweep.yaml`` is the vendor's multi-turn benchmark::

    sweep:
      field: first_prompt_tokens
      values: [256, 1024, 2048, 3072]
      users: 2
      scales:
        published: {values: [2000, 24000], sessions: 10, archetype: {output_tokens: 300}}
"""

from __future__ import annotations

import argparse
import math
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from core import resources, yaml_file
from loadgen.session import SessionPlan, TurnPlan
from loadgen.synth_text import TextSynth, seed_ints
from loadgen.traces.formats import EMPIRICAL_TRACES, REPLAY_FORMATS, resolve, trace_format
from loadgen.traces.replay import reference_reply, seeded_rng

#: The shipped workloads (core.resources).
WORKLOAD_DIR = resources.shipped("workloads")
GapKind = Literal["tool", "think", "pause"]
_GAP_KINDS = ("tool", "think", "pause")


class WorkloadError(ValueError):
    """A workload file is invalid; the message names the file and the field (or YAML line)."""


# ------------------------------------------------------------------------------- distributions


class _Dist(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    min: float | None = None
    max: float | None = None

    @model_validator(mode="after")
    def _clip_order(self) -> _Dist:
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self

    def _draw(self, rng: np.random.Generator, size: int | None) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def sample(self, rng: np.random.Generator, size: int | None = None) -> Any:
        """One draw (float) or ``size`` draws (ndarray), clipped to ``[min, max]``."""
        x = self._draw(rng, size)
        if self.min is not None or self.max is not None:
            x = np.clip(x, self.min, self.max)
        return float(x) if size is None else np.asarray(x, dtype=float)

    def sample_int(self, rng: np.random.Generator, low: int = 0) -> int:
        """One draw rounded to the nearest integer, at least ``low``."""
        return max(low, round(self.sample(rng)))


class Constant(_Dist):
    """Always ``value``."""

    kind: Literal["constant"] = "constant"
    value: float

    def _draw(self, rng, size):
        return self.value if size is None else np.full(size, self.value, dtype=float)


class Uniform(_Dist):
    """Uniform on ``[low, high)`` (``Generator.uniform``)."""

    kind: Literal["uniform"]
    low: float
    high: float

    @model_validator(mode="after")
    def _order(self) -> Uniform:
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) must not exceed high ({self.high})")
        return self

    def _draw(self, rng, size):
        return rng.uniform(self.low, self.high, size)


class LogNormal(_Dist):
    """Log-normal with the given ``median`` (= exp(mu)) and ``sigma`` of the log (``Generator.lognormal``)."""

    kind: Literal["lognormal"]
    median: float = Field(gt=0)
    sigma: float = Field(ge=0)

    def _draw(self, rng, size):
        return rng.lognormal(math.log(self.median), self.sigma, size)


class Exponential(_Dist):
    """Exponential with the given ``mean`` (``Generator.exponential``)."""

    kind: Literal["exponential"]
    mean: float = Field(gt=0)

    def _draw(self, rng, size):
        return rng.exponential(self.mean, size)


#: Fields an empirical distribution can resample from the shipped traces.
EMPIRICAL_FIELDS: dict[str, tuple[str, ...]] = {f: trace_format(f).empirical_fields for f in EMPIRICAL_TRACES}


@lru_cache(maxsize=16)
def empirical_values(trace: str, field: str) -> tuple[float, ...]:
    """The values of ``field`` in the shipped ``trace`` (see :data:`EMPIRICAL_FIELDS`), read by the
    format's own ``empirical`` function (``loadgen.traces.formats``; e.g.
    :func:`loadgen.traces.mooncake.empirical_values`, :func:`loadgen.traces.azure.empirical_values`).
    """
    return tuple(resolve(trace_format(trace).empirical)(field))


class Empirical(_Dist):
    """Resample (with replacement, ``Generator.choice``) from ``values`` or a shipped trace's field,
    times ``scale``."""

    kind: Literal["empirical"]
    values: list[float] | None = None
    trace: Literal[EMPIRICAL_TRACES] | None = None
    field: str | None = None
    scale: float = Field(default=1.0, gt=0)

    @model_validator(mode="after")
    def _source(self) -> Empirical:
        if (self.values is None) == (self.trace is None):
            raise ValueError("give either 'values' or 'trace' (with 'field'), not both or neither")
        if self.values is not None and not self.values:
            raise ValueError("'values' must not be empty")
        if self.trace is not None and self.field not in EMPIRICAL_FIELDS[self.trace]:
            raise ValueError(f"'field' must be one of {', '.join(EMPIRICAL_FIELDS[self.trace])} for trace "
                             f"{self.trace}, got {self.field!r}")
        return self

    def _draw(self, rng, size):
        vals = self.values if self.values is not None else empirical_values(self.trace, self.field)
        return rng.choice(np.asarray(vals, dtype=float), size) * self.scale


def _number_is_constant(v: Any) -> Any:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return {"kind": "constant", "value": v}
    return v


Dist = Annotated[Constant | Uniform | LogNormal | Exponential | Empirical, Field(discriminator="kind"),
                 BeforeValidator(_number_is_constant)]


# ---------------------------------------------------------------------------------- archetypes


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GapSpec(_Model):
    """One gap kind: its probability among the gap kinds and its length in seconds."""

    p: float = Field(ge=0, le=1)
    seconds: Dist


class EditSpec(_Model):
    """How an ``edit`` changes the history: ``keep`` (fraction of the reply's characters kept by a
    compaction), ``first_p`` (probability that the first assistant reply is edited rather than the
    last), ``strip_reasoning_p`` (probability the edit strips reasoning instead of compacting)."""

    keep: Dist = Uniform(kind="uniform", low=0.2, high=0.6)
    first_p: float = Field(default=0.3, ge=0, le=1)
    strip_reasoning_p: float = Field(default=0.0, ge=0, le=1)


class FreshSpec(_Model):
    """The unrelated side request: its prompt and output tokens."""

    prompt_tokens: Dist = Constant(value=200)
    output_tokens: Dist = Constant(value=32)


class ResumeSpec(_Model):
    """A forced resume pauses ``ttl_s + extra_s`` seconds (``extra_s`` > 0)."""

    extra_s: Dist = LogNormal(kind="lognormal", median=300, sigma=1.0, min=1)


class Archetype(_Model):
    """A kind of agent session (see the module doc). Token counts are of the synthesized content;
    the chat template adds its own few tokens per message."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    description: str = ""
    turns: Dist
    system_prompt_tokens: Dist = Constant(value=0)
    first_prompt_tokens: Dist
    new_tokens: dict[GapKind, Dist]
    output_tokens: Dist
    gaps: dict[GapKind, GapSpec]
    retry_p: float = Field(default=0.0, ge=0, le=1)
    edit_p: float = Field(default=0.0, ge=0, le=1)
    fresh_p: float = Field(default=0.0, ge=0, le=1)
    resume_p: float = Field(default=0.0, ge=0, le=1)
    edit: EditSpec = EditSpec()
    fresh: FreshSpec = FreshSpec()
    resume: ResumeSpec = ResumeSpec()

    @field_validator("gaps")
    @classmethod
    def _gaps_sum_to_one(cls, v: dict[str, GapSpec]) -> dict[str, GapSpec]:
        total = sum(g.p for g in v.values())
        if not v or abs(total - 1.0) > 1e-6:
            raise ValueError(f"the gap kinds' p must sum to 1, got {total:g} over {sorted(v)}")
        return v

    @model_validator(mode="after")
    def _new_tokens_for_every_gap(self) -> Archetype:
        need = {k for k, g in self.gaps.items() if g.p > 0} | ({"pause"} if self.resume_p > 0 else set())
        missing = sorted(need - set(self.new_tokens))
        if missing:
            raise ValueError(f"new_tokens has no distribution for gap kind(s) {missing}")
        return self


# ------------------------------------------------------------------------------------- traces


class TraceSource(_Model):
    """A trace replayed as part of the workload.

    ``path``: default the shipped file (mooncake, azure, taubench; required for vllm_multiturn);
    relative paths are looked up next to the workload file, then under the repository root.
    ``sessions``: at most this many (by start time / file order). ``start_s``/``duration_s``: only
    sessions whose first request arrives in this window of trace time (mooncake, azure).
    ``min_turns``/``max_turns``: filter / cut sessions. ``token_scale``: multiplies the trace's token
    lengths (and the Mooncake block size), e.g. 0.1 for a small model. ``replay_timestamps``:
    sessions start at their arrival offset and turns at theirs (else: closed loop, trace gaps as
    gaps). ``gaps``: gap lengths for taubench/vllm_multiturn (``tool``, ``think``). ``output_tokens``:
    override the output length (taubench default: the run's max tokens; vllm_multiturn default:
    the dataset reply's tokens). ``min_new_tokens``: a Mooncake child turn appends at least this.
    ``time_scale``: multiplies this trace's gaps and arrival offsets, on top of the run's time scale.
    ``kv_cache_tester``: ``path`` a trace file or a directory of them (default: the 24 shipped);
    ``sessions`` counts conversations (files), each with its sub-agents.
    """

    format: Literal[REPLAY_FORMATS]
    path: str | None = None
    name: str | None = None
    sessions: int | None = Field(default=None, ge=0)
    start_s: float = Field(default=0.0, ge=0)
    duration_s: float | None = Field(default=None, gt=0)
    min_turns: int = Field(default=1, ge=1)
    max_turns: int | None = Field(default=None, ge=1)
    token_scale: float = Field(default=1.0, gt=0)
    time_scale: float = Field(default=1.0, gt=0)
    replay_timestamps: bool = True
    gaps: dict[Literal["tool", "think"], Dist] = Field(default_factory=dict)
    output_tokens: Dist | None = None
    min_new_tokens: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _path_needed(self) -> TraceSource:
        if not trace_format(self.format).shipped and not self.path:
            raise ValueError(f"'path' is required for format {self.format} (no such file is shipped)")
        return self


class MixEntry(_Model):
    """One entry of the mix: an archetype, or ``include`` (another workload file's mix, its
    weights normalised and multiplied by ``weight``)."""

    weight: float = Field(default=1.0, gt=0)
    archetype: Archetype | None = None
    include: str | None = None

    @model_validator(mode="after")
    def _one_of(self) -> MixEntry:
        if (self.archetype is None) == (self.include is None):
            raise ValueError("give exactly one of 'archetype' or 'include'")
        return self


#: Archetype fields a sweep can vary (token counts).
SWEEP_FIELDS = ("first_prompt_tokens", "system_prompt_tokens")


def _distinct(values: list[int]) -> list[int]:
    if len(set(values)) != len(values):
        raise ValueError(f"values must be distinct, got {values}")
    return values


class SweepScale(_Model):
    """Another scale of the same sweep (e.g. the published one): its own points (``values``,
    tokens), and optionally its own ``sessions``, ``users`` (concurrent sessions), ``settle_s``
    (seconds between points) and ``archetype`` field overrides (applied to every archetype of the
    mix, validated as archetype fields)."""

    values: Annotated[list[Annotated[int, Field(ge=0)]], AfterValidator(_distinct)] = Field(min_length=1)
    sessions: int | None = Field(default=None, ge=1)
    users: int | None = Field(default=None, ge=1)
    settle_s: float | None = Field(default=None, ge=0)
    archetype: dict[str, Any] = Field(default_factory=dict)
    description: str = ""


class Sweep(_Model):
    """A sweep of one archetype field over token counts: one run per value (see the module doc).

    ``field``: ``first_prompt_tokens`` (each session's own context, the vendor's
    ``prefix_num_tokens``) or ``system_prompt_tokens`` (shared by all sessions). ``values``:
    tokens per point. ``users``: concurrent sessions (Locust users). ``settle_s``: seconds to
    wait between points. ``scales``: other scales by name.
    """

    field: Literal["first_prompt_tokens", "system_prompt_tokens"] = "first_prompt_tokens"
    values: Annotated[list[Annotated[int, Field(ge=0)]], AfterValidator(_distinct)] = Field(min_length=1)
    users: int = Field(default=2, ge=1)
    settle_s: float = Field(default=0.0, ge=0)
    scales: dict[str, SweepScale] = Field(default_factory=dict)
    description: str = ""

    @model_validator(mode="after")
    def _positive_context(self) -> Sweep:
        if self.field == "first_prompt_tokens":
            for where, vals in [("values", self.values)] + [(f"scales.{k}.values", v.values)
                                                             for k, v in self.scales.items()]:
                if min(vals) < 1:
                    raise ValueError(f"{where}: first_prompt_tokens values must be >= 1 (a session's first "
                                     f"message has at least one token), got {min(vals)}")
        return self


class HistoryRewrite(_Model):
    """How the client rewrites its earlier replies before sending them back (``loadgen.session.rewrite_reply``;
    docs/workloads.md): ``strip_reasoning`` (drop reasoning fields and ``<think>`` spans),
    ``reasoning_share`` (with it, for a reply without reasoning markers: the fraction of its
    characters, from the start, that stands in for its reasoning), ``rerender_tool_calls``
    (arguments re-serialized, new call ids)."""

    strip_reasoning: bool = False
    reasoning_share: float = Field(default=0.0, ge=0, le=1)
    rerender_tool_calls: bool = False

    def active(self) -> bool:
        return self.strip_reasoning or self.rerender_tool_calls


class Workload(_Model):
    """A workload file (see the module doc). Times in seconds, lengths in tokens."""

    name: str
    description: str = ""
    seed: int = 0
    sessions: int = Field(default=20, ge=0)
    ttl_s: float = Field(default=480.0, gt=0)
    token_scale: float = Field(default=1.0, gt=0)
    ignore_eos: bool = True
    temperature: float = Field(default=0.0, ge=0)
    timeout_s: float = Field(default=300.0, gt=0)
    mix: list[MixEntry] = Field(default_factory=list)
    traces: list[TraceSource] = Field(default_factory=list)
    sweep: Sweep | None = None
    history_rewrite: HistoryRewrite = Field(default_factory=HistoryRewrite)

    @model_validator(mode="after")
    def _something(self) -> Workload:
        if not self.mix and not self.traces:
            raise ValueError("a workload needs a 'mix' of archetypes or 'traces' (or both)")
        if self.sweep is not None:
            if not self.mix:
                raise ValueError("a 'sweep' varies archetype fields: the workload needs a 'mix' of archetypes")
            if self.token_scale != 1.0:
                raise ValueError("a 'sweep' gives its values in tokens: leave token_scale at 1")
        return self

    def archetypes(self) -> list[tuple[float, Archetype]]:
        """(normalised weight, archetype) of every mix entry (includes must be resolved)."""
        entries = [(e.weight, e.archetype) for e in self.mix if e.archetype is not None]
        if len(entries) != len(self.mix):
            raise ValueError("unresolved 'include' entries: load the workload with load_workload()")
        total = sum(w for w, _ in entries)
        return [(w / total, a) for w, a in entries]


def _read_yaml(path: Path) -> dict[str, Any]:
    raw = yaml_file.read_mapping(path, "workload", WorkloadError)
    raw.setdefault("name", path.stem)
    return raw


def _resolve(path_str: str, base: Path) -> Path:
    """A trace path of a workload file: absolute, relative to the file's folder, or a shipped trace
    (``data/traces/...`` as the repository spells it, or a name under ``traces/``)."""
    p = Path(path_str)
    if p.is_absolute():
        return p
    if (base / p).exists():
        return (base / p).resolve()
    return (resources.find_shipped(p, "traces") or base / p).resolve()


def load_workload(path: Path | str, _stack: tuple[Path, ...] = ()) -> Workload:
    """Read, validate and resolve a workload file.

    ``include`` entries are replaced by the included file's archetypes (recursively; weights
    normalised and scaled) and trace paths are made absolute, so the result is self-contained (it
    is what a run records as its workload spec). A path that does not exist is looked up among the
    shipped workloads (``mixed``, ``mixed.yaml``, ``data/workloads/mixed.yaml``; core.resources.find).

    Raises:
        WorkloadError: unreadable file, bad YAML (with its line), a field that fails validation
            (``<file>: mix.0.archetype.turns.kind: ...``), an include cycle or a missing trace file.
    """
    p = resources.find(path, "workloads").resolve()
    if p in _stack:
        raise WorkloadError(f"{p}: include cycle: {' -> '.join(str(x) for x in (*_stack, p))}")
    raw = _read_yaml(p)
    try:
        w = Workload.model_validate(raw)
    except ValidationError as e:
        raise WorkloadError(yaml_file.describe_validation(p, e, "workload")) from None
    mix: list[MixEntry] = []
    for i, e in enumerate(w.mix):
        if e.include is None:
            mix.append(e)
            continue
        inc = load_workload(_resolve(e.include, p.parent), (*_stack, p))
        if not inc.mix:
            raise WorkloadError(f"{p}: mix.{i}.include: {e.include} has no archetypes to include")
        for wt, a in inc.archetypes():
            mix.append(MixEntry(weight=e.weight * wt, archetype=a))
    traces = []
    for i, t in enumerate(w.traces):
        if t.path:
            tp = _resolve(t.path, p.parent)
            if not tp.exists():
                raise WorkloadError(f"{p}: traces.{i}.path: {t.path}: no such file")
            t = t.model_copy(update={"path": str(tp)})
        traces.append(t)
    return w.model_copy(update={"mix": mix, "traces": traces})


def sweep_workloads(w: Workload, scale: str | None = None,
                    values: list[int] | None = None) -> list[tuple[int, Workload]]:
    """The points of ``w``'s sweep: ``(value, workload)`` pairs in ascending value order.

    Each workload is ``w`` without its ``sweep``, with the swept archetype field (``sweep.field``)
    a constant ``value`` tokens in every archetype of the mix. With ``scale`` (a key of
    ``sweep.scales``) that scale's values, sessions and archetype overrides apply. ``values``
    (tokens) replaces the points (each >= 1 for ``first_prompt_tokens``). The workload keeps its
    name and seed, so every point plays the same sessions apart from the swept field.

    Raises:
        WorkloadError: ``w`` has no sweep, an unknown ``scale``, a bad value, or an override
            that is not a valid archetype field (the message names it).
    """
    sw = w.sweep
    if sw is None:
        raise WorkloadError(f"workload {w.name!r} has no 'sweep' section")
    vals, sessions, overrides = list(sw.values), w.sessions, {}
    if scale is not None:
        if scale not in sw.scales:
            known = ", ".join(sorted(sw.scales)) or "none"
            raise WorkloadError(f"workload {w.name!r}: sweep.scales has no {scale!r} (it has: {known})")
        sc = sw.scales[scale]
        vals, sessions, overrides = list(sc.values), sc.sessions or sessions, dict(sc.archetype)
    if values:
        vals = [int(v) for v in values]
    low = 1 if sw.field == "first_prompt_tokens" else 0
    bad = [v for v in vals if v < low]
    if bad or len(set(vals)) != len(vals):
        raise WorkloadError(f"workload {w.name!r}: sweep values must be distinct integers >= {low} "
                            f"({sw.field}), got {vals}")
    if sw.field in overrides:
        raise WorkloadError(f"workload {w.name!r}: sweep.scales.{scale}.archetype.{sw.field}: the swept "
                            "field takes the sweep's values, not an override")
    out = []
    for v in sorted(vals):
        mix = []
        for i, e in enumerate(w.mix):
            data = e.archetype.model_dump() | overrides | {sw.field: {"kind": "constant", "value": v}}
            try:
                a = Archetype.model_validate(data)
            except ValidationError as err:
                where = f"sweep.scales.{scale}.archetype" if scale else f"mix.{i}.archetype"
                raise WorkloadError("\n".join(f"workload {w.name!r}: {where}.{'.'.join(map(str, x['loc']))}: "
                                              f"{x['msg']}" for x in err.errors())) from None
            mix.append(e.model_copy(update={"archetype": a}))
        out.append((v, w.model_copy(update={"mix": mix, "sessions": sessions, "sweep": None})))
    return out


# ------------------------------------------------------------------------------------ planning


def _tokens(d: _Dist, rng: np.random.Generator, scale: float, low: int = 1) -> int:
    """One token-count draw times ``scale``, rounded, at least ``low``."""
    return max(low, round(d.sample(rng) * scale))


def plan_archetype_session(arch: Archetype, index: int, w: Workload, synth: TextSynth, *,
                           time_scale: float = 1.0, token_scale: float | None = None,
                           system_text: str = "") -> SessionPlan:
    """Plan archetype session ``index`` of workload ``w`` (see the module doc for the rules).

    Draws come from ``defaultseeded_rng([w.seed, 1, index])`` in a fixed order; texts from ``synth``
    keyed by the session id. ``system_text`` is the archetype's shared system prompt; token draws
    are multiplied by ``token_scale`` (default ``w.token_scale``).
    """
    ts = w.token_scale if token_scale is None else token_scale
    rng = seeded_rng(w.seed, 1, index)
    sid = f"a{index:05d}-{arch.name}"
    n_turns = arch.turns.sample_int(rng, low=1)
    first = _tokens(arch.first_prompt_tokens, rng, ts)
    msgs0: list[dict[str, Any]] = [{"role": "system", "content": system_text}] if system_text else []
    msgs0.append({"role": "user", "content": synth.text(first, f"{sid}/0/user")})
    out0 = _tokens(arch.output_tokens, rng, ts)
    turns = [TurnPlan(msgs0, reference_reply(synth.text(out0, f"{sid}/0/ref")), max_tokens=out0)]
    kinds = [k for k in _GAP_KINDS if k in arch.gaps]
    probs = np.array([arch.gaps[k].p for k in kinds])
    for k in range(1, n_turns):
        if rng.random() < arch.fresh_p:
            fp = _tokens(arch.fresh.prompt_tokens, rng, ts)
            fo = _tokens(arch.fresh.output_tokens, rng, ts)
            turns.append(TurnPlan([{"role": "user", "content": synth.text(fp, f"{sid}/{k}/fresh")}],
                                  reference_reply(""), 0.0, "none", "fresh", max_tokens=fo))
        out = _tokens(arch.output_tokens, rng, ts)
        if rng.random() < arch.retry_p:
            turns.append(TurnPlan([], reference_reply(synth.text(out, f"{sid}/{k}/ref")), 0.0, "none", "retry",
                                  max_tokens=out))
            continue
        if rng.random() < arch.resume_p:
            gkind, gap = "pause", w.ttl_s + arch.resume.extra_s.sample(rng)
        else:
            gkind = str(kinds[int(rng.choice(len(kinds), p=probs / probs.sum()))])
            gap = arch.gaps[gkind].seconds.sample(rng)
        gap = max(gap, 0.0)
        kind = "resume" if gap > w.ttl_s else "turn"
        new = _tokens(arch.new_tokens[gkind], rng, ts)
        text = synth.text(new, f"{sid}/{k}/new")
        msg = ({"role": "tool", "tool_call_id": f"call_{k}", "content": text} if gkind == "tool"
               else {"role": "user", "content": text})
        edit = None
        if rng.random() < arch.edit_p and kind == "turn":
            kind = "edit"
            style = "strip_reasoning" if rng.random() < arch.edit.strip_reasoning_p else "compact"
            target = "first" if rng.random() < arch.edit.first_p else "last"
            edit = {"style": style, "target": target, "keep": float(np.clip(arch.edit.keep.sample(rng), 0, 1))}
        turns.append(TurnPlan([msg], reference_reply(synth.text(out, f"{sid}/{k}/ref")), gap * time_scale, gkind, kind,
                              max_tokens=out, edit=edit))
    return SessionPlan(session_id=sid, source=f"synthetic:{arch.name}", turns=turns, archetype=arch.name)


def plan_trace(src: TraceSource, si: int, w: Workload, synth: TextSynth, time_scale: float) -> list[SessionPlan]:
    """Plans of one trace source (``si``: its position in ``w.traces``, part of the session ids);
    ``time_scale`` (the run's) is multiplied by the source's own ``time_scale``."""
    time_scale *= src.time_scale
    return resolve(trace_format(src.format).replay)(src, si, w, synth, time_scale)


def plan_workload(w: Workload, synth: TextSynth, *, time_scale: float = 1.0,
                  sessions: int | None = None, token_scale: float | None = None) -> list[SessionPlan]:
    """All sessions of a workload, in the order users should take them.

    Args:
        w: a resolved workload (:func:`load_workload`).
        synth: text synthesizer for the served tokenizer (its seed should be ``w.seed``).
        time_scale: multiplies every gap and arrival offset (e.g. 0.01 compresses minutes to
            seconds); a turn is a ``resume`` by its unscaled gap against ``w.ttl_s``.
        sessions: archetype sessions to draw (default ``w.sessions``); traces bring their own.
        token_scale: multiplies the archetypes' token draws (default ``w.token_scale``); trace
            sources have their own ``token_scale``.

    Returns:
        Archetype sessions (no start time, closed loop) followed by trace sessions ordered by start
        time (``start_at_s``, seconds after the run starts, already scaled).
    """
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    plans: list[SessionPlan] = []
    n = w.sessions if sessions is None else sessions
    ts = w.token_scale if token_scale is None else token_scale
    if not ts > 0:
        raise ValueError(f"token_scale must be > 0, got {ts}")
    arch = w.archetypes() if w.mix else []
    if arch and n:
        weights = np.array([wt for wt, _ in arch])
        system = {}
        for _, a in arch:
            if a.name not in system:
                tokens = _tokens(a.system_prompt_tokens, seeded_rng(w.seed, 2, *seed_ints(a.name)), ts, low=0)
                system[a.name] = synth.text(tokens, f"system/{a.name}") if tokens else ""
        for i in range(n):
            pick = int(seeded_rng(w.seed, 0, i).choice(len(arch), p=weights))
            a = arch[pick][1]
            plans.append(plan_archetype_session(a, i, w, synth, time_scale=time_scale, token_scale=ts,
                                                system_text=system[a.name]))
    trace_plans: list[SessionPlan] = []
    for si, src in enumerate(w.traces):
        trace_plans.extend(plan_trace(src, si, w, synth, time_scale))
    trace_plans.sort(key=lambda p: p.start_at_s if p.start_at_s is not None else 0.0)
    return plans + trace_plans


def describe(plans: list[SessionPlan]) -> str:
    """A short human-readable summary of planned sessions: counts of turns by kind and gap kind,
    planned output tokens, the longest gap (seconds, after time scaling: the larger of a turn's
    ``gap_before_s`` and, for replayed traces, the time between consecutive arrivals ``at_s``)."""
    kinds: Counter = Counter()
    gks: Counter = Counter()
    arch: Counter = Counter()
    out_tokens = 0
    longest = 0.0
    for p in plans:
        arch[p.archetype] += 1
        prev_at = None
        for t in p.turns:
            kinds[t.kind] += 1
            gks[t.gap_kind] += 1
            out_tokens += t.max_tokens or 0
            longest = max(longest, t.gap_before_s)
            if t.at_s is not None:  # a replayed trace: the arrival-to-arrival gap is the trace's own
                if prev_at is not None:
                    longest = max(longest, t.at_s - prev_at)
                prev_at = t.at_s
    n = sum(kinds.values())
    return (f"{len(plans)} sessions {dict(arch)}; {n} requests by kind {dict(kinds)}, by gap {dict(gks)}; "
            f"{out_tokens} planned output tokens; longest gap {longest:.1f} s")


def main(argv: list[str] | None = None) -> int:
    """``python -m loadgen.workload FILE --tokenizer DIR``: validate a workload and summarise its plan."""
    ap = argparse.ArgumentParser(prog="python -m loadgen.workload", description=main.__doc__)
    ap.add_argument("workload", help="workload YAML (or a name under data/workloads/)")
    ap.add_argument("--tokenizer", default=str(resources.home() / "models" / "turnscope-tiny"),
                    help="tokenizer.json or model directory (default: the embedded model)")
    ap.add_argument("--sessions", type=int, default=None)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--token-scale", type=float, default=None)
    a = ap.parse_args(argv)
    from loadgen.synth_text import LocalTokenizer

    try:
        w = load_workload(a.workload)
    except WorkloadError as e:
        print(e)
        return 2
    from loadgen.traces.errors import TraceFormatError

    try:
        plans = plan_workload(w, TextSynth(LocalTokenizer(a.tokenizer), w.seed), time_scale=a.time_scale,
                              sessions=a.sessions, token_scale=a.token_scale)
    except TraceFormatError as e:  # one line naming file, line and field; no traceback
        print(f"workload {w.name}: {e}")
        return 2
    print(f"workload {w.name} (seed {w.seed}): {describe(plans)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
