"""serving/engine_idle_wait.py: the wrapped engine step and reader wait, on stand-ins of vLLM's
EngineCoreProc and SpinCondition (the real loops are checked through real workers in
tests/integration/test_pd_bidir_vllm.py: D holding a turn's KV uses a few % of its core)."""

import queue
import threading
import time
import types

import pytest

from serving import engine_idle_wait


class _Engine:
    """Like vLLM's EngineCoreProc where the wrapper touches it: a step that says whether it ran the
    model, a scheduler with unfinished requests or not, the input queue and its handler."""

    def __init__(self, unfinished: bool, executed: bool):
        self.scheduler = types.SimpleNamespace(has_unfinished_requests=lambda: unfinished)
        self.executed = executed
        self.input_queue: queue.Queue = queue.Queue()
        self.handled: list[tuple] = []
        self.steps = 0

    def _process_engine_step(self) -> bool:
        self.steps += 1
        return self.executed

    def _handle_client_request(self, request_type, request) -> None:
        self.handled.append((request_type, request))


def _patched(unfinished: bool, executed: bool, wait_s: float = 0.2) -> _Engine:
    cls = type("Engine", (_Engine,), {})
    assert engine_idle_wait.patch_engine_class(cls, wait_s)
    assert not engine_idle_wait.patch_engine_class(cls, wait_s)  # patched once
    return cls(unfinished, executed)


def test_an_empty_step_with_only_held_kv_waits_for_input():
    e = _patched(unfinished=False, executed=False, wait_s=0.2)
    t0 = time.monotonic()
    assert e._process_engine_step() is False
    assert 0.19 <= time.monotonic() - t0 < 1.0  # the whole wait: nothing arrived
    assert e.steps == 1 and e.handled == []


def test_a_request_arriving_ends_the_wait_and_is_handled():
    e = _patched(unfinished=False, executed=False, wait_s=5.0)
    threading.Timer(0.05, lambda: e.input_queue.put(("ADD", "req-1"))).start()
    t0 = time.monotonic()
    e._process_engine_step()
    assert time.monotonic() - t0 < 1.0  # not the 5 s wait
    assert e.handled == [("ADD", "req-1")]


@pytest.mark.parametrize("unfinished, executed", [(True, False), (False, True), (True, True)])
def test_steps_with_work_are_left_as_vllm_runs_them(unfinished, executed):
    e = _patched(unfinished=unfinished, executed=executed, wait_s=5.0)
    t0 = time.monotonic()
    assert e._process_engine_step() is executed
    assert time.monotonic() - t0 < 1.0 and e.handled == []


def test_a_class_without_the_handler_is_left_alone():
    cls = type("Other", (), {"_process_engine_step": lambda self: False})
    assert not engine_idle_wait.patch_engine_class(cls, 0.02)


class _SpinCondition:
    """Like vLLM's SpinCondition: a reader spins ``busy_loop_s`` after its last read, then sleeps."""

    def __init__(self, busy_loop_s: float = 1.0):
        self.busy_loop_s = busy_loop_s
        self.waits: list[float] = []

    def wait(self, timeout_ms=None):
        self.waits.append(self.busy_loop_s)


def test_a_reader_spins_at_most_the_short_window_before_it_sleeps():
    cls = type("Spin", (_SpinCondition,), {})
    assert engine_idle_wait.patch_reader_spin(cls, 0.005)
    assert not engine_idle_wait.patch_reader_spin(cls, 0.005)  # patched once
    reader, writer = cls(1.0), cls(0.0)   # vLLM's reader default, and a writer (0: no spin)
    reader.wait(timeout_ms=10)
    writer.wait()
    assert (reader.waits, writer.waits) == ([0.005], [0.0])
