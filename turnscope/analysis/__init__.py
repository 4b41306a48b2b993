"""The statistics the CLI, the planner and the dashboard share: speed-ups with bootstrap confidence
intervals (:mod:`~turnscope.analysis.speedup`, :mod:`~turnscope.analysis.headline`), sessions
needed to settle one (:mod:`~turnscope.analysis.sample_size`), the prefix sweep's speed-ups and
prefill fit (:mod:`~turnscope.analysis.sweep_stats`), the plan's check against measured runs
(:mod:`~turnscope.analysis.plan_check`), the per-run P/D check (:mod:`~turnscope.analysis.pd_check`)
and the workers' KV cache configuration (:mod:`~turnscope.analysis.worker_cache`). It imports only
the ground layer (docs/design.md).
"""
