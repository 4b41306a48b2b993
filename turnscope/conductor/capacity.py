"""``turnscope capacity``: ramp concurrent sessions step by step against ``pd`` and ``pd-bidir``
with the same small decode (D) KV space, one run per (mode, step). Planning and wiring only.

The question (docs/capacity.md): at how many concurrent
sessions does holding KV on D (``bidirectional_kv_xfer``) start to cost capacity, and how much
latency does reuse buy below that point. vLLM 0.32 pins a finished request's blocks on D until
P pulls them (or frees them unread, below ``kv_recompute_threshold``) or ``decoder_kv_blocks_ttl``
passes (``nixl/pull_scheduler.py: request_finished``,
``base_worker.py: _reap_expired_send_leases``), a session's last turn included; pinned blocks
are not free for new requests, which wait on D (``vllm:num_requests_waiting``) or preempt
running ones (``vllm:num_preemptions``). In ``pd`` D frees a request's blocks when it finishes.

D's KV space is set with ``--kv-cache-memory-bytes`` on the decode role only
(:meth:`CapacityPlan.topology`; P keeps the topology's); the connector's TTL and the proxy's
margin come from the plan. Each step is its own run (own run id, own prefix-cache salt) with
``users`` concurrent sessions playing ``sessions`` in all; every mode's workers start once and
play the steps in ascending order. Under the interleaved schedule (the default) both modes'
workers are up together and the steps alternate, step i of each mode (in an order drawn per step)
before step i + 1 of either (``turnscope.conductor.evaluation._run_interleaved_runs``), so the machine's drift
falls on both modes; handles a ``pd-bidir`` step leaves pinned on D are there when its next step
starts unless the TTL passed during ``pd``'s step between them (each step's D KV usage at its
start is in the store). Sequential: one mode's whole ramp back to back, then the other's. Each run records ``runs_log.workload_spec.capacity``
(:meth:`CapacityPlan.spec`) and the SLO in ``runs.config.slo``; the ``capacity_steps`` view
(data/schema.sql, docs/schema/overview.md) reads them back.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from analysis.capacity_crossing import BASELINE, TREATMENT
from core.contract import Role
from loadgen.workload import load_workload
from serving.topology import RoleSettings, Topology
from turnscope.conductor import console_text
from turnscope.conductor.evaluation import EvalSettings, RunPlan, Slo, run_eval

#: The two modes compared, baseline first (``analysis.capacity_crossing``, which reads the ramp): P's prefix
#: cache on in both, D holding KV only in pd-bidir.
CAPACITY_MODES = (BASELINE, TREATMENT)
#: Default load steps (concurrent sessions = Locust users).
DEFAULT_USERS = (1, 2, 3, 4, 6)
#: Default D KV space (tokens): twice the embedded model's max_model_len (8,192), i.e. 64 MiB at its
#: 4 KiB/token: about seven of the capacity workload's longest contexts (~2,300 tokens, 19 blocks of
#: 128), so the finished sessions' pinned last turns crowd out running requests within a few users.
DEFAULT_DECODE_KV_TOKENS = 16_384
#: Default decoder_kv_blocks_ttl (seconds) and proxy margin for the capacity workload's ~15 s sessions
#: (data/workloads/capacity.yaml says why the TTL is scaled with the session length).
DEFAULT_TTL_S = 20
DEFAULT_MARGIN_S = 5.0


@dataclass(frozen=True)
class CapacityStep:
    """One load step: its position (0-based), concurrent sessions (``users``) and sessions played."""

    index: int
    users: int
    sessions: int


@dataclass(frozen=True)
class CapacityPlan:
    """A capacity ramp, planned: ``capacity_id`` (prefix of its run ids), the ``workload`` file,
    the ``steps``, the ``slo``, D's KV space (``decode_kv_cache_bytes``, bytes, and
    ``decode_kv_tokens``), the connector's ``ttl_s`` (decoder_kv_blocks_ttl, seconds), the proxy's
    ``handle_ttl_margin_s`` and ``settle_s`` (seconds between steps)."""

    capacity_id: str
    workload: Path
    workload_name: str
    steps: tuple[CapacityStep, ...]
    slo: Slo
    decode_kv_tokens: int
    decode_kv_cache_bytes: int
    ttl_s: int
    handle_ttl_margin_s: float
    settle_s: float = 0.0
    prefill_kv_tokens: int | None = None
    prefill_kv_cache_bytes: int | None = None

    @property
    def aggregated_kv_cache_bytes(self) -> int | None:
        """The aggregated worker's KV space under P's eviction ladder (bytes): P's plus D's, the
        single worker given the memory the two P/D workers have together (the fair baseline,
        docs/eviction.md); None when P's space is not set (the worker keeps the topology's)."""
        if self.prefill_kv_cache_bytes is None:
            return None
        return self.prefill_kv_cache_bytes + self.decode_kv_cache_bytes

    def run_id(self, mode: str, step: CapacityStep) -> str:
        """``<capacity_id>-<mode>-u<users>``: unique per ramp, mode and step."""
        return f"{self.capacity_id}-{mode}-u{step.users}"

    def spec(self, step: CapacityStep) -> dict:
        """What a step's run records in ``runs_log.workload_spec`` (JSON; units in the key names)."""
        return {"capacity": {"id": self.capacity_id, "workload": self.workload_name, "step": step.index,
                             "users": step.users, "sessions": step.sessions,
                             "steps": [s.users for s in self.steps],
                             "decode_kv_cache_bytes": self.decode_kv_cache_bytes,
                             "decode_kv_tokens": self.decode_kv_tokens, "decoder_kv_blocks_ttl_s": self.ttl_s,
                             "slo_ttft_s": self.slo.ttft_s, "slo_tpot_s": self.slo.tpot_s}
                | ({"prefill_kv_cache_bytes": self.prefill_kv_cache_bytes, "prefill_kv_tokens": self.prefill_kv_tokens,
                    "aggregated_kv_cache_bytes": self.aggregated_kv_cache_bytes}
                   if self.prefill_kv_cache_bytes is not None else {})}

    def topology(self, base: Topology) -> Topology:
        """``base`` with D's KV space, the TTL and the proxy margin of this plan: the decode role's
        args get ``--kv-cache-memory-bytes`` (after the topology's own, so it wins for D only); with
        P's space set (the eviction ladder), the prefill role's get P's and the aggregated role's
        P's plus D's (:attr:`aggregated_kv_cache_bytes`)."""
        roles = dict(base.roles)
        sizes = {Role.DECODE: self.decode_kv_cache_bytes}
        if self.prefill_kv_cache_bytes is not None:
            sizes |= {Role.PREFILL: self.prefill_kv_cache_bytes, Role.AGGREGATED: self.aggregated_kv_cache_bytes}
        for role, size in sizes.items():
            have = roles.get(role)
            args = (list(have.args) if have else []) + ["--kv-cache-memory-bytes", str(size)]
            roles[role] = have.model_copy(update={"args": args}) if have else RoleSettings(args=args)
        return base.model_copy(update={
            "roles": roles,
            "connector": base.connector.model_copy(update={"decoder_kv_blocks_ttl": self.ttl_s}),
            "proxy": base.proxy.model_copy(update={"handle_ttl_margin_s": self.handle_ttl_margin_s})})

    def runs(self, base: EvalSettings, modes: list[str], history: str) -> dict[str, list[RunPlan]]:
        """Per mode, one run per step in ascending order: ``base`` with the workload, the step's
        users and sessions, the SLO, and this plan's topology."""
        topo = self.topology(base.topology)
        out: dict[str, list[RunPlan]] = {}
        for mode in modes:
            out[mode] = [RunPlan(run_id=self.run_id(mode, st), history=history, spec=self.spec(st),
                                 settle_s=self.settle_s if st.index else 0.0,
                                 settings=base.model_copy(update={
                                     "workload": self.workload, "users": st.users, "sessions": st.sessions,
                                     "histories": [history], "slo": self.slo, "topology": topo}))
                         for st in self.steps]
        return out


def plan_capacity(workload: Path, *, capacity_id: str, users: list[int], sessions_per_user: int, slo: Slo,
                  topology: Topology, kv_bytes_per_token: int, decode_kv_tokens: int = DEFAULT_DECODE_KV_TOKENS,
                  ttl_s: int = DEFAULT_TTL_S, handle_ttl_margin_s: float = DEFAULT_MARGIN_S,
                  settle_s: float = 0.0, prefill_kv_tokens: int | None = None) -> CapacityPlan:
    """Plan a ramp (pure: nothing is written or started).

    ``users``: the steps' concurrent sessions (strictly ascending, each >= 1); each step plays
    ``users x sessions_per_user`` sessions. D gets ``decode_kv_tokens x kv_bytes_per_token`` bytes
    of KV space; with ``prefill_kv_tokens`` (P's eviction ladder, docs/eviction.md) P gets
    ``prefill_kv_tokens x kv_bytes_per_token`` bytes and the aggregated worker P's plus D's (None:
    both keep the topology's).

    Raises:
        ValueError: the workload is invalid (``WorkloadError``, naming the file and field); the
            steps are not strictly ascending positive integers; ``sessions_per_user`` < 1; D's KV
            space holds fewer tokens than the topology's ``max_model_len`` (vLLM would refuse to
            start D), or P's (``prefill_kv_tokens``) likewise; the proxy's handle TTL (``ttl_s - handle_ttl_margin_s``) is not positive.
    """
    w = load_workload(workload)
    if not users:
        raise ValueError("--users: give at least one load step (e.g. 1,2,3,4,6)")
    if any(u < 1 for u in users) or any(b <= a for a, b in itertools.pairwise(users)):
        raise ValueError(f"--users: load steps must be strictly ascending integers >= 1, got {users}")
    if sessions_per_user < 1:
        raise ValueError(f"--sessions-per-user must be >= 1, got {sessions_per_user}")
    if topology.max_model_len and decode_kv_tokens < topology.max_model_len:
        raise ValueError(f"--decode-kv-tokens {decode_kv_tokens} is below max_model_len {topology.max_model_len} "
                         f"of topology {topology.name!r}: vLLM would refuse to start D (one request of the "
                         "model's full length must fit)")
    if prefill_kv_tokens is not None and topology.max_model_len and prefill_kv_tokens < topology.max_model_len:
        raise ValueError(f"--prefill-kv-tokens {prefill_kv_tokens} is below max_model_len {topology.max_model_len} "
                         f"of topology {topology.name!r}: vLLM would refuse to start P (one request of the "
                         "model's full length must fit)")
    if ttl_s - handle_ttl_margin_s <= 0:
        raise ValueError(f"--ttl-s {ttl_s} minus the proxy margin {handle_ttl_margin_s:g} s leaves no time to "
                         "offer a handle: give a longer TTL or a smaller --handle-ttl-margin-s")
    return CapacityPlan(
        capacity_id=capacity_id, workload=Path(workload), workload_name=w.name,
        steps=tuple(CapacityStep(i, u, u * sessions_per_user) for i, u in enumerate(users)),
        slo=slo, decode_kv_tokens=decode_kv_tokens, decode_kv_cache_bytes=decode_kv_tokens * kv_bytes_per_token,
        ttl_s=ttl_s, handle_ttl_margin_s=handle_ttl_margin_s, settle_s=settle_s,
        prefill_kv_tokens=prefill_kv_tokens,
        prefill_kv_cache_bytes=None if prefill_kv_tokens is None else prefill_kv_tokens * kv_bytes_per_token)


def run_capacity(base: EvalSettings, plan: CapacityPlan, history: str, console: Console | None = None) -> list[str]:
    """Run ``plan`` for ``base.modes``: one worker start per mode, every step on it, each its own
    recorded run. Returns the run ids in the order they ran.

    Raises:
        ValueError: a bad mode or history, or a run id the store already holds (before anything
            starts); RuntimeError/OSError from the workers or the store.
    """
    runs = plan.runs(base, list(base.modes), history)
    taken = [r.run_id for rs in runs.values() for r in rs if (Path(base.store) / "runs" / r.run_id).exists()]
    if taken:
        raise ValueError(f"the store {base.store} already holds run {taken[0]}: give another --capacity-id")
    base = base.model_copy(update={"topology": plan.topology(base.topology), "slo": plan.slo})
    return run_eval(base, console or Console(), runs=runs, interleave_runs=True)


def print_capacity_summary(store: Path, run_ids: list[str], console: Console) -> None:
    """Print each step's numbers per mode (goodput, TTFT/E2E p50/p90, D's KV usage, held handle
    bytes, D's waiting requests, preemptions) and the crossing in words (``analysis.capacity_crossing``)."""
    from rich.table import Table

    from analysis import capacity_crossing as capacity
    from store import db
    from store.queries import capacity as capacity_queries

    steps = db.read(db.StoreLocation(Path(store)), capacity_queries.capacity_steps, run_ids)
    if steps.empty:
        return
    table = Table(title=f"capacity ramp {steps['capacity_id'].iloc[0]}: SLO TTFT <= "
                        f"{steps['slo_ttft_s'].iloc[0] * 1e3:.0f} ms, TPOT <= {steps['slo_tpot_s'].iloc[0] * 1e3:.0f} ms")
    evicting = "prefill_kv_cache_bytes" in steps and steps["prefill_kv_cache_bytes"].notna().any()
    cols = ("users", "mode", "turns", "met SLO", "goodput/s", "TTFT p50/p90 ms", "E2E p50/p90 ms",
            "D KV start/peak %", "handles peak MiB", "D waiting peak", "D preempt") + (
            ("P hit %", "pulled from D") if evicting else ())
    for c in cols:
        table.add_column(c, justify="left" if c == "mode" else "right")

    def num(v, fmt: str) -> str:
        return "" if v is None or math.isnan(v) else format(v, fmt)

    for r in steps.sort_values(["users", "mode"]).itertuples():
        table.add_row(str(r.users), r.mode, str(r.turns), str(r.slo_turns), num(r.goodput_per_s, ".2f"),
                      f"{num(r.ttft_p50_s * 1e3, '.0f')}/{num(r.ttft_p90_s * 1e3, '.0f')}",
                      f"{num(r.e2e_p50_s * 1e3, '.0f')}/{num(r.e2e_p90_s * 1e3, '.0f')}",
                      f"{num(r.decode_kv_usage_start * 100, '.0f')}/{num(r.decode_kv_usage_max * 100, '.0f')}",
                      num(r.handle_bytes_max / 2**20, ".1f"), num(r.decode_waiting_max, ".0f"),
                      num(r.decode_preemptions, ".0f"),
                      *((num(r.p_hit_rate * 100, ".1f"), num(r.pulled_tokens, ",.0f")) if evicting else ()))
    console_text.print_table(console, table)
    console.print(capacity.crossing_words(capacity.find_crossing(steps)).replace("**", "").replace("`", ""),
                  highlight=False)
    if evicting:  # P's eviction ladder: the window (analysis.eviction_window)
        from analysis import eviction_window

        turns = db.read(db.StoreLocation(Path(store)), capacity_queries.capacity_turns, run_ids)
        console.print(eviction_window.window_words(eviction_window.find_window(steps, turns))
                      .replace("**", "").replace("`", ""), highlight=False)
