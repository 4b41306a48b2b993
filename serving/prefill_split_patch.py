"""Make a prefill worker's answer carry vLLM's own split of its cached prompt tokens: how many came
from its local prefix cache and how many it pulled over the KV connector.

vLLM 0.32 counts both per request (``vllm/v1/metrics/stats.py: PrefillStats``, set when the scheduler
first schedules the request, ``Scheduler.schedule``) and sums them into P's counter
``vllm:prompt_tokens_by_source_total{source="local_cache_hit"|"external_kv_transfer"}``, but its
answer carries only their sum, ``kv_transfer_params["remote_prefill_cached_tokens"]``
(``Scheduler.update_from_output``, for a request that pulled from a remote worker). Without the
split the proxy had to guess P's local part from its index of P's cache, which under eviction
was 23.5% off vLLM's counter (docs/eviction.md).

:func:`apply` wraps ``Scheduler.update_from_output``: every engine output that carries
``remote_prefill_cached_tokens`` and its request's ``prefill_stats`` (vLLM sets both on the same
output) also gets :data:`EXTERNAL_KEY` and :data:`LOCAL_KEY`, the very figures vLLM adds to that
counter, so the proxy's per-turn pulled tokens sum to it exactly. The scheduler runs in the engine-core
process; :mod:`serving.vllm_worker` applies the patch in its API-server process and in the processes
vLLM spawns from it (the engine core among them; see that module). Where the worker is vLLM's own
server (a topology's ``entry: vllm``) the keys are absent and the proxy falls back to its estimate
(``serving.proxy``). It never edits site-packages.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

#: The key of P's ``kv_transfer_params`` with the tokens vLLM counted as pulled for the request
#: (``PrefillStats.num_external_cached_tokens``).
EXTERNAL_KEY = "turnscope_external_cached_tokens"
#: The key with the tokens vLLM counted as its local prefix-cache hit (``num_local_cached_tokens``).
LOCAL_KEY = "turnscope_local_cached_tokens"
#: vLLM's key for their sum, which marks a request that pulled (or was offered) remote KV.
CACHED_KEY = "remote_prefill_cached_tokens"
_PATCHED_ATTR = "__turnscope_prefill_split__"
log = logging.getLogger("vllm.turnscope")  # under vLLM's logger: the line lands in the worker's log


def annotate(engine_core_outputs: dict[int, Any]) -> int:
    """Add :data:`EXTERNAL_KEY` and :data:`LOCAL_KEY` to the ``kv_transfer_params`` of every output
    in ``engine_core_outputs`` (``{client index: EngineCoreOutputs}``) that has :data:`CACHED_KEY`
    and ``prefill_stats``. Returns the number of outputs annotated."""
    n = 0
    for eco in engine_core_outputs.values():
        for out in getattr(eco, "outputs", None) or ():
            params, stats = out.kv_transfer_params, out.prefill_stats
            if stats is None or not isinstance(params, dict) or CACHED_KEY not in params:
                continue
            params[EXTERNAL_KEY] = int(stats.num_external_cached_tokens)
            params[LOCAL_KEY] = int(stats.num_local_cached_tokens)
            n += 1
    return n


def patch_scheduler_class(cls) -> bool:
    """Wrap ``cls.update_from_output`` (vLLM's ``Scheduler``) so that its result goes through
    :func:`annotate`. Returns False when patched already or when the class has no such method."""
    update = getattr(cls, "update_from_output", None)
    if update is None or getattr(update, _PATCHED_ATTR, False):
        return False

    @functools.wraps(update)
    def update_from_output(self, *args, **kwargs):
        result = update(self, *args, **kwargs)
        annotate(result)
        return result

    setattr(update_from_output, _PATCHED_ATTR, True)
    cls.update_from_output = update_from_output
    return True


def apply() -> bool:
    """Patch vLLM's scheduler (see the module doc); True when a patch was applied now. Idempotent."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if not patch_scheduler_class(Scheduler):
        return False
    log.info("turnscope: P's answers carry vLLM's split of their cached tokens (%s, %s)", EXTERNAL_KEY, LOCAL_KEY)
    return True
