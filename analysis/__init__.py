"""The statistics the CLI, the planner and the dashboard share: speed-ups with bootstrap confidence
intervals (:mod:`~analysis.speedup`, :mod:`~analysis.headline`), sessions needed to settle one
(:mod:`~analysis.sample_size`), the prefix sweep's speed-ups and prefill fit
(:mod:`~analysis.sweep_stats`), the plan's check against measured runs (:mod:`~analysis.plan_check`)
and the per-run P/D check (:mod:`~analysis.pd_check`). It imports only the ground and the store
(docs/design.md).
"""
