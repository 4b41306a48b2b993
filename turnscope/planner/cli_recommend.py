"""``turnscope recommend``: read the traffic and profile, print the ledger of retention strategies at
the current setting (:mod:`turnscope.planner.ledger`) and the recommended setting as a config diff
(:mod:`turnscope.planner.recommend`). Every figure is a FORECAST labelled with its profile and inputs
(docs/planner.md, "Ledger and recommendation")."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from turnscope.planner.cli_plan import read_traffic
from turnscope.planner.ledger import STRATEGIES, Prices, describe_ledger, ledger
from turnscope.planner.profile import GiB, Sourced, load_profile
from turnscope.planner.recommend import Grid, Limits, Setting, describe, recommend
from turnscope.planner.simulate import PlanSettings


def run_recommend(paths: Sequence[Path], *, profile_path: Path, format: str | None, current: Setting,
                  margin_s: float, ttft_slo_s: float | None, d_kv_gib: float | None, gpu_hour_usd: float | None,
                  host_gib_hour_usd: float | None, max_prefill_workers: int, serve_model: str,
                  shared_prefix_tokens: int = 0, grid: Grid | None = None, platform: str = "gpu") -> str:
    """The whole command. Raises ValueError/OSError with a clear message (an unknown strategy, a
    negative price, an unreadable traffic or profile)."""
    if platform not in ("cpu", "gpu"):
        raise ValueError(f"--platform {platform!r}: expected cpu or gpu")
    if current.strategy not in STRATEGIES:
        raise ValueError(f"--current-strategy {current.strategy!r}: expected one of {', '.join(STRATEGIES)}")
    for name, v in (("--gpu-hour-usd", gpu_hour_usd), ("--host-gib-hour-usd", host_gib_hour_usd),
                    ("--d-kv-gib", d_kv_gib), ("--ttft-slo-s", ttft_slo_s)):
        if v is not None and v < 0:
            raise ValueError(f"{name} must not be negative, got {v}")
    prof = load_profile(profile_path)
    traffic, inputs = read_traffic(paths, format)
    prices = Prices(gpu_hour_usd, host_gib_hour_usd)
    limits = Limits(ttft_slo_s, None if d_kv_gib is None else d_kv_gib * GiB, prices, max_prefill_workers)
    base = PlanSettings(handle_ttl_margin_s=margin_s, shared_prefix_tokens=shared_prefix_tokens)
    if current.decode_kv_bytes is not None:
        prof = prof.model_copy(update={"decode_kv_space_bytes": Sourced(value=current.decode_kv_bytes,
                                                                        source="the current setting")})
    at = base.model_copy(update={"decoder_kv_blocks_ttl_s": current.ttl_s, "kv_recompute_threshold": current.threshold,
                                 "prefill_workers": current.prefill_workers, "decode_workers": current.decode_workers,
                                 "routing": current.routing})
    head = f"Traffic: {', '.join(i['path'] + ' (' + i['format'] + ')' for i in inputs)}; {len(traffic):,} requests."
    table = describe_ledger(ledger(traffic, prof, at, prices), prof, at, prices)
    rec = recommend(traffic, prof, base, current, limits, grid or Grid())
    return "\n\n".join([head, table, describe(rec, prof, base, limits, serve_model, platform)])
