"""``turnscope sweep``: a workload's prefix-length sweep, one run per (mode, point). Wiring only.

The workload file carries a ``sweep`` section (``loadgen.workload.Sweep``;
``data/workloads/vendor-sweep.yaml`` is the vendor's multi-turn benchmark, vLLM blog
2026-10-12). :func:`plan_sweep` turns it into one plain workload per point
(``loadgen.workload.sweep_workloads``: the swept field a constant), the run ids and the
parameters recorded with each run; :func:`run_sweep` writes the point workloads to
``<log_dir>/sweeps/<sweep_id>/p<value>/<workload name>.yaml`` and hands them to
``turnscope.conductor.evaluation.run_eval`` as that function's ``runs``: each mode's workers start once
and play every point in ascending order, each point its own run with its own prefix-cache salt.

Every point's ``runs_log.workload_spec`` holds ``{"sweep": {...}}`` (:meth:`SweepPlan.spec`):
the sweep's name and id, the swept field, ``prefix_tokens`` (the point's value, tokens), its
index, all values, the scale, sessions and users; and ``"workload"``: the point's workload as
run. The ``sweep_points`` view (data/schema.sql) reads them back.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml
from rich.console import Console

from core.modes import SWEEP_ORDER
from loadgen.workload import Workload, load_workload, sweep_workloads
from turnscope.conductor.evaluation import EvalSettings, RunPlan, run_eval

#: The modes in the order the sweep runs them: the vendor's A/B first, then the real baselines.
SWEEP_MODES = SWEEP_ORDER
#: Tokens the chat template adds per message at most (role markers, separators), for the size check.
TEMPLATE_TOKENS_PER_MESSAGE = 16


@dataclass(frozen=True)
class SweepPoint:
    """One point: the swept field's value (tokens), its position, its workload and where the
    workload's YAML goes."""

    value: int
    index: int
    workload: Workload
    path: Path


@dataclass(frozen=True)
class SweepPlan:
    """A sweep, planned: ``sweep_id`` (``<label>-<stamp>``), the workload's ``name``, the swept
    ``field``, the ``scale`` (None: the file's own), its points, and the run settings it asks for:
    ``users`` (concurrent sessions), ``settle_s`` (seconds between points), ``sessions`` per point."""

    sweep_id: str
    name: str
    field: str
    scale: str | None
    points: tuple[SweepPoint, ...]
    users: int
    settle_s: float
    sessions: int

    @property
    def values(self) -> list[int]:
        """The points' values (tokens), ascending."""
        return [p.value for p in self.points]

    def run_id(self, mode: str, history: str, point: SweepPoint) -> str:
        """``<sweep_id>-<mode>-<history>-p<value>``: unique per sweep, mode, history and point."""
        return f"{self.sweep_id}-{mode}-{history}-p{point.value}"

    def spec(self, point: SweepPoint) -> dict:
        """What a point's run records in ``runs_log.workload_spec`` (JSON)."""
        return {"sweep": {"name": self.name, "id": self.sweep_id, "field": self.field,
                          "prefix_tokens": point.value, "index": point.index, "values": self.values,
                          "scale": self.scale or "default", "sessions": self.sessions, "users": self.users},
                "workload": point.workload.model_dump(mode="json", exclude_none=True)}

    def runs(self, base: EvalSettings, modes: list[str], histories: list[str]) -> dict[str, list[RunPlan]]:
        """Per mode, the runs to make on its workers: every history, every point ascending. Each
        run's settings are ``base`` with the point's workload file, the sweep's sessions and users,
        one history, and room for the longest prompt (``max_prompt_tokens``)."""
        max_prompt = max_prompt_tokens(base, self.points)
        out: dict[str, list[RunPlan]] = {}
        for mode in modes:
            runs = []
            for history in histories:
                for point in self.points:
                    settings = base.model_copy(update={
                        "workload": point.path, "sessions": self.sessions, "users": self.users,
                        "histories": [history], "max_prompt_tokens": max_prompt})
                    runs.append(RunPlan(run_id=self.run_id(mode, history, point), history=history,
                                        settings=settings, spec=self.spec(point),
                                        settle_s=self.settle_s if runs else 0.0))
            out[mode] = runs
        return out


def plan_sweep(workload: Path | str, *, sweep_id: str, out_dir: Path,
               scale: str | None = None, values: list[int] | None = None) -> SweepPlan:
    """Plan the sweep of the workload file ``workload`` (pure: nothing is written or started).

    ``sweep_id`` names the sweep and prefixes its run ids (the CLI uses ``<label>-<UTC stamp>``,
    or the operator's ``--sweep-id`` to put modes run one at a time, as on attached GPU workers,
    into one sweep); point files go under ``out_dir/<sweep id>/p<value>/``. ``scale`` picks one of
    the file's ``sweep.scales`` (None: the file's own values); ``values`` (tokens) overrides the
    points.

    Raises:
        WorkloadError: the file is invalid, has no ``sweep``, or an unknown scale or bad value.
    """
    w = load_workload(workload)
    points = sweep_workloads(w, scale=scale, values=values)
    sw = w.sweep
    sc = sw.scales.get(scale) if scale else None
    return SweepPlan(
        sweep_id=sweep_id, name=w.name, field=sw.field, scale=scale,
        points=tuple(SweepPoint(v, i, pw, out_dir / sweep_id / f"p{v}" / f"{w.name}.yaml")
                     for i, (v, pw) in enumerate(points)),
        users=(sc.users if sc and sc.users else sw.users),
        settle_s=(sc.settle_s if sc and sc.settle_s is not None else sw.settle_s),
        sessions=points[0][1].sessions)


def _upper(dist) -> float | None:
    """A distribution's largest value: a constant's value, else its ``max`` clip (None: unbounded)."""
    return dist.value if getattr(dist, "kind", None) == "constant" else dist.max


def largest_prompt_tokens(w: Workload) -> int | None:
    """An upper bound on the longest prompt a session of ``w``'s archetypes sends (tokens): shared
    system prompt + first prompt + every later turn's new tokens + every reply but the last,
    plus :data:`TEMPLATE_TOKENS_PER_MESSAGE` per message. None when a distribution is unbounded."""
    worst = 0
    for _, a in w.archetypes():
        parts = [_upper(a.turns), _upper(a.system_prompt_tokens), _upper(a.first_prompt_tokens),
                 _upper(a.output_tokens)] + [_upper(d) for d in a.new_tokens.values()]
        if any(p is None for p in parts):
            return None
        turns, system, first, out = (int(p) for p in parts[:4])
        new = int(max(parts[4:]))
        messages = 1 + (1 if system else 0) + 2 * (turns - 1)
        worst = max(worst, system + first + (turns - 1) * (new + out) + TEMPLATE_TOKENS_PER_MESSAGE * messages)
    return worst


def max_prompt_tokens(base: EvalSettings, points: tuple[SweepPoint, ...] | list[SweepPoint]) -> int:
    """The ``max_prompt_tokens`` a sweep runs with (tokens): the model's context less the longest
    reply when the topology gives ``max_model_len``, else room for the longest planned prompt.

    Raises:
        ValueError: a point's longest prompt (:func:`largest_prompt_tokens`) plus its reply does
            not fit the model's context; it names the first such point and both sizes.
    """
    limit = base.topology.max_model_len
    longest_out = max(int(_upper(a.output_tokens) or 0) for p in points for _, a in p.workload.archetypes())
    for p in points:
        need = largest_prompt_tokens(p.workload)
        if limit and need is not None and need + longest_out > limit:
            raise ValueError(f"point {p.value} of sweep {p.workload.name!r} needs prompts of up to {need} tokens "
                             f"plus {longest_out} output, more than max_model_len {limit} of topology "
                             f"{base.topology.name!r}: use smaller values or a larger model context")
    if limit:
        return limit - longest_out
    return max((largest_prompt_tokens(p.workload) or 0) for p in points) + 1024


def write_workloads(plan: SweepPlan) -> None:
    """Write each point's workload as YAML at its path (``run_eval`` and Locust read it there)."""
    for p in plan.points:
        p.path.parent.mkdir(parents=True, exist_ok=True)
        p.path.write_text(f"# point {p.index} ({p.value} tokens of {plan.field}) of sweep {plan.sweep_id}\n"
                          + yaml.safe_dump(p.workload.model_dump(mode="json", exclude_none=True), sort_keys=False))


def run_sweep(base: EvalSettings, plan: SweepPlan, console: Console | None = None) -> list[str]:
    """Run ``plan`` for ``base.modes`` x ``base.histories``: one worker start per mode, every point
    on it, each its own recorded run. Returns the run ids in the order they ran.

    Raises:
        ValueError: a bad mode or history, a point that does not fit the model's context, or a
            run id the store already holds (before anything starts); RuntimeError/OSError from
            the workers or the store.
    """
    runs = plan.runs(base, list(base.modes), list(base.histories))
    taken = [r.run_id for rs in runs.values() for r in rs if (Path(base.store) / "runs" / r.run_id).exists()]
    if taken:
        raise ValueError(f"the store {base.store} already holds run {taken[0]} ({len(taken)} of this sweep's "
                         "runs exist): give another --sweep-id, or a --modes that has not run yet")
    write_workloads(plan)
    return run_eval(base, console or Console(), runs=runs)
