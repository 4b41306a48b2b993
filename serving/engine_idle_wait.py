"""vLLM's idle loops made to wait while a worker only holds finished requests' KV: a vLLM general
plugin for the CPU workers.

vLLM 0.32's scheduler counts a finished request whose blocks wait on the KV connector's delayed
free as work (``Scheduler.has_finished_requests``, part of ``has_requests``): a bidirectional D
keeps every finished turn's blocks for ``decoder_kv_blocks_ttl`` (480 s by default), P keeps a
prefilled request's blocks until D pulls them or ``kv_lease_duration`` runs out. While anything is
held, ``EngineCoreProc.run_busy_loop`` steps back to back, each empty step a round trip to the
model-runner process with a 1 ms sleep after it (``_process_engine_step``): a whole core per worker
(measured: D holding one turn 99.8% of a core, the same D once the TTL freed it 7.8%;
docs/known-behaviour.md). On the embedded default several modes' workers share the 2 cores, so a
bidirectional D holding its sessions' last turns slows the other modes' workers on its core for
the whole TTL, which biases an A/B run with the modes up together.

When ``TURNSCOPE_ENGINE_IDLE_WAIT_MS`` holds a positive integer, :func:`register` makes the engine
loop, after a step that executed nothing while no request is unfinished, wait up to that many
milliseconds for the next client request (a new request, an abort, a utility call) instead of
stepping again at once; a request that arrives ends the wait at once and is handled as vLLM's own
loop handles it. What waits longer: the connector's polls of its held blocks (a pull that finished,
a TTL or a lease that ran out), so blocks are freed up to that many milliseconds later. Requests
that are still unfinished (running, waiting, waiting for remote KV) keep vLLM's loop as it is.
turnscope sets it for every CPU worker it launches (``serving.workers.CPU_ENGINE_IDLE_WAIT_MS``; a
topology's ``env`` overrides it, 0 restores vLLM's loop); without the variable, or at 0, the plugin
changes nothing. A worker without a KV connector never holds a finished request, so for it only
the reader's spin below changes (an aggregated worker's 1 s spin after every request slowed the P
workers sharing its core: docs/known-behaviour.md). With it, the plugin also makes
every reader of vLLM's shared-memory message queue (the model-runner process reading each engine
step) spin :data:`READER_SPIN_S` after its last message instead of vLLM's 1 s before it sleeps on
its notify socket: otherwise steps 50 ms apart keep the model runner spinning a whole core
(measured: engine core 0.03, model runner 0.95 of a core; with both 0.14 in all, D holding one turn).

vLLM loads the plugin in each of its processes through the ``vllm.general_plugins`` entry point
(pyproject.toml; vLLM docs, "Plugin System"); the loop runs in the engine-core process.
"""

from __future__ import annotations

import logging
import queue

from serving.plugin_env import positive_int

ENV = "TURNSCOPE_ENGINE_IDLE_WAIT_MS"
_PATCHED_ATTR = "__turnscope_idle_wait_s__"
log = logging.getLogger("vllm.turnscope")  # under vLLM's logger: the line lands in the worker's log


def wait_ms(environ: dict[str, str] | None = None) -> int | None:
    """The wait asked for in ``environ`` (default: ``os.environ``), milliseconds; None when unset or
    0 (vLLM's own loop). Raises ValueError naming the variable for a value that is not a
    non-negative integer (:func:`serving.plugin_env.positive_int`)."""
    return positive_int(ENV, "milliseconds", environ)


def patch_engine_class(cls, wait_s: float) -> bool:
    """Wrap ``cls._process_engine_step`` (vLLM's ``EngineCoreProc``) so that a step that executed
    nothing while the scheduler has no unfinished request is followed by a wait of up to ``wait_s``
    seconds on ``self.input_queue``; an item that arrives is handled with
    ``self._handle_client_request`` as vLLM's ``_process_input_queue`` does. Returns False when the
    class was patched already or lacks what the wrapper uses (another vLLM version)."""
    step = getattr(cls, "_process_engine_step", None)
    if step is None or getattr(step, _PATCHED_ATTR, None) is not None or not hasattr(cls, "_handle_client_request"):
        return False

    def _process_engine_step(self) -> bool:
        executed = step(self)
        if not executed and not self.scheduler.has_unfinished_requests():
            try:
                item = self.input_queue.get(timeout=wait_s)
            except queue.Empty:
                return executed
            self._handle_client_request(*item)
        return executed

    setattr(_process_engine_step, _PATCHED_ATTR, wait_s)
    _process_engine_step.__doc__ = step.__doc__
    cls._process_engine_step = _process_engine_step
    return True


#: Seconds a reader of vLLM's shared-memory message queue spins after its last message before it
#: sleeps on its notify socket (vLLM's ``SpinCondition.busy_loop_s``, 1 s, not configurable): the
#: model-runner process reads every engine step from it, so with steps tens of milliseconds apart it
#: would spin the whole time (measured: D holding one turn, the engine core waiting, the model-runner
#: process still 95% of a core).
READER_SPIN_S = 0.005


def patch_reader_spin(cls, spin_s: float) -> bool:
    """Wrap ``cls.wait`` (vLLM's ``SpinCondition``) so that a reader spins at most ``spin_s`` seconds
    after its last read before it sleeps on the notify socket, which the writer pings on every
    message. Returns False when patched already or when the class lacks ``wait``."""
    wait = getattr(cls, "wait", None)
    if wait is None or getattr(wait, _PATCHED_ATTR, None) is not None:
        return False

    def _wait(self, *args, **kwargs):
        if getattr(self, "busy_loop_s", 0) > spin_s:
            self.busy_loop_s = spin_s
        return wait(self, *args, **kwargs)

    setattr(_wait, _PATCHED_ATTR, spin_s)
    _wait.__doc__ = wait.__doc__
    cls.wait = _wait
    return True


def register() -> None:
    """vLLM's general-plugin hook: patch the engine loop when ``TURNSCOPE_ENGINE_IDLE_WAIT_MS`` is
    set; otherwise do nothing."""
    wait = wait_ms()
    if wait is None:
        return
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
        from vllm.v1.engine.core import EngineCoreProc
    except ImportError:
        return
    patch_reader_spin(SpinCondition, READER_SPIN_S)
    if patch_engine_class(EngineCoreProc, wait / 1000.0):
        log.info("turnscope: the engine waits up to %d ms for input while it only holds finished requests' KV (%s)",
                 wait, ENV)
