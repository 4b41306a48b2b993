"""NIXL's progress thread made to pause between polls: a vLLM general plugin for the CPU workers.

nixl's Python agent (``nixl_cu12/_api.py`` and ``nixl_cu13/_api.py`` of nixl 1.5.1,
``nixl_agent.__init__``) creates its agent with ``pthrDelay = 0``: the progress thread polls its
backends (UCX) without a pause, and each NIXL worker holds a whole CPU core with it, idle or busy
(measured here: 99% of a core per idle P and per idle D worker). On a GPU node that thread has a
host core of its own; on the embedded default every thread of a worker is pinned to the worker's
one core (``serving.workers``), so P's prefill and D's decode steps share their core with it and
aggregated serving (no NIXL) does not: a P/D-against-aggregated comparison there measures that
thread, and idle workers slow everything else on the machine.

When ``TURNSCOPE_NIXL_PROGRESS_DELAY_US`` holds a positive integer, :func:`register` makes every
NIXL agent created in the process keep that delay between its progress thread's polls
(microseconds; the agent's ``pthrDelay``). turnscope sets it for the CPU workers it launches
(``serving.workers.CPU_NIXL_PROGRESS_DELAY_US``; a topology's ``env`` overrides it, 0 restores
nixl's own polling); without the variable, or at 0, the plugin changes nothing, so other vLLM
processes of the same environment are untouched.

vLLM loads the plugin in each of its processes (API server, engine core, worker) through the
``vllm.general_plugins`` entry point (pyproject.toml; vLLM docs, "Plugin System"); the agent is
created in the worker process (``nixl/base_worker.py``, "Initializing NIXL wrapper").
"""

from __future__ import annotations

import logging

from serving.plugin_env import positive_int

ENV = "TURNSCOPE_NIXL_PROGRESS_DELAY_US"
_PATCHED_ATTR = "__turnscope_progress_delay__"
log = logging.getLogger("vllm.turnscope")  # under vLLM's logger: the line lands in the worker's log


def delay_us(environ: dict[str, str] | None = None) -> int | None:
    """The delay asked for in ``environ`` (default: ``os.environ``), microseconds; None when unset or
    0 (nixl's own polling without a pause). Raises ValueError naming the variable for a value that is not a
    non-negative integer (:func:`serving.plugin_env.positive_int`)."""
    return positive_int(ENV, "microseconds", environ)


def patch_config_class(bind, delay: int) -> bool:
    """Replace ``bind.nixlAgentConfig`` (nixl's pybind module) with a subclass whose ``pthrDelay``
    is ``delay`` wherever the agent would set 0. Returns False when it was patched already."""
    base = bind.nixlAgentConfig
    if getattr(base, _PATCHED_ATTR, None) is not None:
        return False

    class DelayedAgentConfig(base):
        """nixl's agent config whose progress thread pauses ``delay`` µs between polls."""

        def __setattr__(self, name, value):
            if name == "pthrDelay" and value == 0:
                value = delay
            super().__setattr__(name, value)

    setattr(DelayedAgentConfig, _PATCHED_ATTR, delay)
    bind.nixlAgentConfig = DelayedAgentConfig
    return True


def register() -> None:
    """vLLM's general-plugin hook: patch nixl's agent config when ``TURNSCOPE_NIXL_PROGRESS_DELAY_US``
    is set and nixl is installed; otherwise do nothing."""
    delay = delay_us()
    if delay is None:
        return
    try:
        import nixl  # noqa: F401  (selects the CUDA-major build and installs it as nixl._api)
        from nixl import _api
    except ImportError:
        return
    if patch_config_class(_api.nixlBind, delay):
        log.info("turnscope: NIXL progress thread pauses %d us between polls (%s)", delay, ENV)
